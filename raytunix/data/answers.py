"""The one rule for comparing a final answer with a task's reference answer.

Every scoring path that judges a math answer (the math environments' training reward, and
so held-out evaluation, which reads that reward) calls ``answers_match``. The rule, in
order:

0. **Normalise** both texts with ``normalize_text`` (the same function the held-out leak
   check keys questions with): invisible format characters removed (zero-width space and
   joiners U+200B-U+200D, word joiner U+2060, BOM U+FEFF, soft hyphen, bidirectional
   marks), super- and subscripts written as ``^{...}`` / ``_{...}``, then Unicode NFKC
   (fullwidth ``４２`` is ``42``, ``ﬁ`` is ``fi``, a no-break space is a space). A
   reference with nothing left to compare (``blank_answer``: empty, whitespace, ``.``,
   ``$$``, ``\\boxed{}``) never matches, whatever the answer: a dataset row without a
   reference must not pay the policy for answering nothing.
1. **Unwrap** both texts: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``)
   if there is one; then surrounding whitespace, one pair of ``$...$``, ``\\(...\\)`` or
   ``\\[...\\]`` math delimiters and one trailing ``.`` are removed.
2. **Plain numbers** compare exactly, as rationals (no tolerance). A plain number is an
   optional sign (``+``, ``-`` or the Unicode minus ``−``), an optional leading currency
   ``$``, digits with optional ``,`` thousands separators in groups of three, an optional
   decimal part, an optional exponent ``e``/``E`` (at most 400 in size) and an optional
   trailing ``%``, which is dropped (a unit mark, as GSM8K writes percent answers: ``12%``
   matches ``12``, not ``0.12``); or a fraction of two such integers ``a/b`` (b != 0).

   ========================  ==========  ====================================
   answer                    reference   match
   ========================  ==========  ====================================
   ``1,000``                 ``1000``    yes (thousands separators)
   ``1e3``                   ``1000``    yes (scientific notation)
   ``0.50``                  ``1/2``     yes (same rational)
   ``\\boxed{42}``            ``42``      yes (the box is unwrapped)
   ``$18``                   ``18``      yes (currency sign)
   ``12%``                   ``12``      yes (percent sign dropped)
   ``-3``                    ``3``       no  (sign matters)
   ``0.333``                 ``1/3``     no  (no tolerance)
   ``1,00``                  ``100``     no  (not a thousands grouping)
   ========================  ==========  ====================================

3. **Math expressions**: when the reference has no word in it (no run of two letters once
   LaTeX commands such as ``\\frac`` are removed), both texts are parsed with Hugging
   Face's ``math-verify`` (LaTeX and plain expressions: ``\\frac{1}{2}``, ``\\sqrt{8}``,
   ``2\\pi``, ``x+1``, intervals, sets) and compared symbolically (``math_verify.verify``
   with the reference as gold), so ``\\frac{1}{2}`` matches ``0.5`` and ``2\\sqrt{2}``
   matches ``\\sqrt{8}``.
4. **Text** otherwise: equal after case folding and collapsing runs of whitespace
   (``Paris`` matches ``paris``).

Texts longer than ``MAX_ANSWER_CHARS`` never match. Symbolic comparison of adversarial
input can run without end (``9^{9^{9}}`` is a 370-million-digit integer to sympy) and
math-verify's own timeout (``signal.alarm``) works only in a main thread, so step 3 runs in
a helper process (spawned, one per process that needs it) with a deadline of
``SYMBOLIC_TIMEOUT_S``; past it the helper is killed and the answer does not match.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from fractions import Fraction

from raytunix import profiling

MAX_ANSWER_CHARS = 256  # longer answers are not compared (score 0)
MAX_EXPONENT = 400  # |e| of 1e<e> accepted as a plain number (bigger would build huge ints)
SYMBOLIC_TIMEOUT_S = 5.0  # deadline of one symbolic comparison (step 3), seconds
# How long a fresh helper may take to start and import math-verify, apart from the deadline
# of the comparison: on a loaded host the import alone can take longer than 5 s.
SYMBOLIC_STARTUP_TIMEOUT_S = 120.0

_INTEGER = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
_NUMBER = re.compile(
    rf"^(?P<sign>[+\-])?\$?(?P<int>{_INTEGER})?(?P<frac>\.\d+)?(?:[eE](?P<exp>[+\-]?\d+))?%?$"
)
_FRACTION = re.compile(rf"^(?P<sign>[+\-])?(?P<num>{_INTEGER})\s*/\s*(?P<den>{_INTEGER})$")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
# Format characters that change a text's code points but not how it reads.
_INVISIBLE = re.compile(
    "[\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]"
)
_SUPERSCRIPTS = "\u2070\u00b9\u00b2\u00b3" + "".join(
    map(chr, range(0x2074, 0x207F))
)  # 0-9 + - = ( )
_SUBSCRIPTS = "".join(map(chr, range(0x2080, 0x208F)))
_SCRIPT_RUN = re.compile(f"[{_SUPERSCRIPTS}]+|[{_SUBSCRIPTS}]+")
_DELIMITER_TEXT = re.compile(r"\\[()\[\]]|[${}]")
# Characters that render as blank space but are letters or symbols to Unicode (Hangul
# fillers are Lo, the blank braille cell is So): read as a space.
_BLANK_FILLERS = str.maketrans(dict.fromkeys("\u115f\u1160\u3164\uffa0\u2800\U0001d159", " "))
# LaTeX that typesets as space or nothing: spacing and line-break commands, struts, size
# and style switches, colours, phantoms and explicit skips (a braced argument may hold one
# level of braces, \\phantom{\\frac{1}{2}}); and text and font wrappers, whose (removed)
# braces leave just their content.
_BRACED = r"\{(?:[^{}]|\{[^{}]*\})*\}"
_LATEX_BLANK = re.compile(
    r"\\(?:quad|qquad|enspace|enskip|thinspace|medspace|thickspace|negthinspace"
    r"|negmedspace|negthickspace|hfill|hfil|vfill|vfil|hss|smallskip|medskip|bigskip"
    r"|newline|linebreak|nolinebreak|pagebreak|space|nobreakspace|null|relax|strut"
    r"|mathstrut|displaystyle|textstyle|scriptstyle|scriptscriptstyle|tiny|scriptsize"
    r"|footnotesize|small|normalsize|large|Large|LARGE|huge|Huge|left|right|middle"
    r"|[bB]igg?[lrm]?|mathord|mathbin|mathrel|mathop|mathpunct|mathinner)(?![A-Za-z])"
    r"|\\[,;:!> ]|\\\\|~"
    r"|\\(?:hspace|vspace|hphantom|vphantom|phantom|mspace|color|colorbox)\*?\s*"
    + _BRACED
    + r"|\\textcolor\s*"
    + _BRACED
    + r"|\\(?:kern|mkern|hskip|vskip|mskip|mspace)\s*(?:"
    + _BRACED
    + r"|[+-]?[\d.]+\s*(?:pt|em|ex|mu|cm|mm|in|bp|pc|sp|dd|cc))"
    r"|\\(?:text|textrm|textbf|textit|textsf|texttt|textnormal|textup|textsl|textsc|emph"
    r"|mathrm|mathbf|mathit|mathsf|mathtt|mathbb|mathcal|mathfrak|mathscr|mathnormal"
    r"|boldsymbol|bm|operatorname|mbox|hbox|fbox|makebox|underline|overline)(?![A-Za-z])"
)


def answers_match(answer: str | None, reference: str) -> bool:
    """Whether ``answer`` states ``reference``, by the module's rule (unwrap, exact plain
    numbers, math-verify for math expressions, else case-folded text).

    Args:
      answer: the model's final answer (e.g. the content of ``<answer>``); None never
        matches.
      reference: the task's answer.

    Raises:
      TypeError: ``reference`` is not a string.
    """
    if not isinstance(reference, str):
        raise TypeError(
            f"reference answer must be a str, got {type(reference).__qualname__} "
            f"({reference!r:.60}); store answers as text."
        )
    if answer is None or len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    given, expected = unwrap(normalize_text(answer)), unwrap(normalize_text(reference))
    if _blank(expected):
        return False
    given_number, expected_number = parse_number(given), parse_number(expected)
    if given_number is not None and expected_number is not None:
        return given_number == expected_number
    if text_key(given) == text_key(expected):
        return True
    if not expected or _WORD.search(_LATEX_COMMAND.sub(" ", expected)):
        return False
    return _symbolic_match(given, expected)


def normalize_text(text: str) -> str:
    """``text`` as answers and questions are compared: invisible format characters
    (U+00AD, U+061C, U+180E, U+200B-U+200F, U+202A-U+202E, U+2060-U+2064, U+2066-U+2069,
    U+FEFF) removed, runs of super-/subscript digits and signs written as ``^{...}`` /
    ``_{...}`` (NFKC alone would turn ``2²`` into ``22``), then Unicode NFKC (compatibility
    forms: fullwidth digits and letters, ligatures, no-break spaces), and the fraction
    slash U+2044 that NFKC leaves in ``½`` as ``/``. Case and whitespace are kept (see
    ``text_key``)."""
    text = _INVISIBLE.sub("", text).translate(_BLANK_FILLERS)
    if _SCRIPT_RUN.search(text):
        text = _SCRIPT_RUN.sub(_script_run, text)
    return unicodedata.normalize("NFKC", text).replace("\u2044", "/")


def text_key(text: str) -> str:
    """``normalize_text(text)`` with whitespace runs collapsed to one space, stripped and
    case-folded: the key under which two answers compare as text, and under which a
    held-out question is the same as a training one (``datasets.drop_leaked``)."""
    return " ".join(normalize_text(text).split()).casefold()


def blank_answer(text: str) -> bool:
    """Whether ``text`` holds nothing a reference answer could be compared with: once
    normalised (``normalize_text``) and unwrapped (``unwrap``), and without math
    delimiters (``$``, ``\\(``, ``\\)``, ``\\[``, ``\\]``) and braces, no letter,
    digit or symbol (Unicode categories L, N, S) is left. ``""``, ``"  "``, ``"."``,
    ``"$$"``, ``"\\boxed{}"``, ``"\\u200b"`` and ``"..."`` are blank; ``"0"``, ``"x"``,
    ``"+"`` and ``"∅"`` are not. LaTeX that typesets as space or nothing does not count:
    ``"\\quad"``, ``"\\,"``, ``"~"``, ``"\\hspace{1em}"``, ``"\\phantom{x}"``, an empty
    ``"\\text{}"`` (``"\\text{yes}"`` and ``"\\pi"`` are not blank); nor do characters
    that render blank (Hangul fillers U+115F, U+1160, U+3164, U+FFA0; the blank braille
    cell U+2800), which ``normalize_text`` reads as spaces."""
    return _blank(unwrap(normalize_text(text)))


def _blank(unwrapped: str) -> bool:
    core = _DELIMITER_TEXT.sub("", _LATEX_BLANK.sub("", unwrapped))
    return not any(unicodedata.category(c)[0] in "LNS" for c in core)


def _script_run(match: re.Match) -> str:
    run = match.group()
    if run[0] in _SUPERSCRIPTS:
        return "^{" + run.translate(_PLAIN_SUPERSCRIPTS) + "}"
    return "_{" + run.translate(_PLAIN_SUBSCRIPTS) + "}"


_PLAIN_SUPERSCRIPTS = str.maketrans(_SUPERSCRIPTS, "0123456789+-=()")
_PLAIN_SUBSCRIPTS = str.maketrans(_SUBSCRIPTS, "0123456789+-=()")


def unwrap(text: str) -> str:
    """The answer inside ``text``: the last ``\\boxed{...}``'s content if any, without
    surrounding whitespace, one pair of math delimiters and one trailing period."""
    boxed = _last_boxed(text)
    text = (boxed if boxed is not None else text).strip()
    for left, right in _DELIMITERS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
            break
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational if it is a plain number by the module's rule (see the
    table), else None. ``"1,000"`` -> 1000, ``"0.50"`` -> 1/2, ``"1e3"`` -> 1000,
    ``"3/4"`` -> 3/4, ``"12%"`` -> 12, ``"1,00"`` -> None."""
    text = text.strip().replace("\u2212", "-")
    match = _FRACTION.match(text)
    if match:
        den = int(match["den"].replace(",", ""))
        if den == 0:
            return None
        value = Fraction(int(match["num"].replace(",", "")), den)
        return -value if match["sign"] == "-" else value
    match = _NUMBER.match(text)
    if not match or not (match["int"] or match["frac"]):
        return None
    exponent = int(match["exp"] or 0)
    if abs(exponent) > MAX_EXPONENT:
        return None
    mantissa = Fraction((match["int"] or "0").replace(",", "") + (match["frac"] or ""))
    value = mantissa * Fraction(10) ** exponent
    return -value if match["sign"] == "-" else value


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def _symbolic_match(given: str, expected: str) -> bool:
    return _WORKER.compare(given, expected, SYMBOLIC_TIMEOUT_S)


def symbolic_equal(given: str, expected: str) -> bool:
    """math-verify's verdict on ``given`` against the gold ``expected`` (both wrapped in
    ``$...$`` so LaTeX parses), in the calling thread with no deadline; False when either
    does not parse. ``answers_match`` runs it in the helper process."""
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    timeout = int(SYMBOLIC_TIMEOUT_S) if in_main else None
    gold = parse(f"${expected}$", parsing_timeout=timeout)
    target = parse(f"${given}$", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


def _serve(conn) -> None:
    """The helper process: answers ``(given, expected)`` pairs with ``symbolic_equal``."""
    # Its notice that the timeout is off is not the user's concern; the parent keeps time.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401 - imported before "ready", so no deadline pays for it

    conn.send("ready")
    while True:
        try:
            given, expected = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            conn.send(symbolic_equal(given, expected))
        except Exception:  # noqa: BLE001 - an answer sympy cannot handle does not match
            conn.send(False)


class _SymbolicWorker:
    """One spawned helper process (spawned, not forked: the caller may run JAX threads),
    started on first use and replaced after a comparison past its deadline is killed.
    Comparisons from several threads take turns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def compare(self, given: str, expected: str, timeout_s: float) -> bool:
        with self._lock:
            try:
                if self._process is None or not self._process.is_alive():
                    self._start()
                self._conn.send((given, expected))
                if self._conn.poll(timeout_s):
                    return bool(self._conn.recv())
            except (EOFError, OSError):  # the helper died; the next call starts another
                pass
            self._stop()
            return False

    def _start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child,), daemon=True, name="raytunix-math-verify"
        )
        self._process.start()
        child.close()
        if not (self._conn.poll(SYMBOLIC_STARTUP_TIMEOUT_S) and self._conn.recv() == "ready"):
            raise OSError(
                f"the math-verify helper did not start within {SYMBOLIC_STARTUP_TIMEOUT_S:.0f} s"
            )

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


_WORKER = _SymbolicWorker()


def score_answer(task, answer: str | None) -> float:
    """Reward of ``answer`` for a math ``task`` (a ``raytunix.types.Task``): 1.0 if
    ``answers_match(answer, task.answer)``, else 0.0. The math environments' reward, and so
    the held-out success rate, come from here (timed as a ``reward`` span)."""
    with profiling.span("reward", "env", {"rule": "math"}):
        return 1.0 if answers_match(answer, task.answer) else 0.0
