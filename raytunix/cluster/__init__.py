"""Running on a cluster, beside the RL code: Ray job submission (``jobs``), where actors
go (``placement``), scaling env and sandbox actors during a run (``scaling``), the stuck-
call watchdog (``watchdog``) and the garbage-collector settings of long-lived actors
(``heap``)."""
