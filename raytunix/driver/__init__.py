"""The driver of the main job, in steps: ``raytunix.train.train`` calls them in order.

run_dir.py   the run directory, the config a resume keeps, RunError
prepare.py   Ray, the tasks, the tokenizer, the prompt check, the demonstrations
job.py       Job: the actors of one run; started_job brings them up and down
steps.py     open_run, warm_start, evaluate, begin_rl / restore_rl, rl_loop,
             export_policy, summarise
"""
