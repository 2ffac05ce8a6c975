"""Claims a notebook makes about its own outputs, checked where they are made.

A sentence under a plot is only as good as the measurement beside it. Two tools keep them
together: ``say`` renders Markdown from the values a cell just measured (so a quoted figure
is the figure), and ``claim`` asserts a comparative statement right after its measurement,
with bounds wide enough for a noisy 2-core machine. When a claim stops being true, the cell
raises ``ClaimFailed`` naming it, and the notebook tests (nbval) fail on that cell.
"""

from __future__ import annotations

import math
import numbers


class ClaimFailed(AssertionError):
    """A notebook's sentence no longer matches what its cell measured."""


def truth(holds) -> bool:
    """``holds`` as a Python bool if it is a real boolean: a bool, a numpy bool or a 0-d bool array or
    tensor (what a comparison of numpy / torch scalars gives). Anything else is a TypeError: a list,
    a string, a number or NaN is "true" to ``bool()`` whatever was measured, a claim that cannot fail."""
    if isinstance(holds, bool):
        return holds
    if getattr(holds, "ndim", None) == 0 and str(getattr(holds, "dtype", "")) in ("bool", "torch.bool"):
        return bool(holds)
    got = type(holds).__name__
    if getattr(holds, "shape", None) is not None:
        got += f" of shape {tuple(holds.shape)}, dtype {getattr(holds, 'dtype', None)}"
    raise TypeError(
        f"claim needs holds to be a boolean (a comparison such as x < y, or bool((a == b).all()) for arrays), "
        f"got {got}: {holds!r}"[:400]
    )


def claim(name: str, holds: bool, measured: str = "") -> None:
    """Raise ``ClaimFailed`` unless ``holds``; ``name`` quotes the claim, ``measured`` what was seen.

    ``holds`` must be a real boolean (``truth``), so that a claim can fail: the result of a comparison,
    not the measured value itself."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"claim needs name to be the claim's sentence (a non-empty str), got {name!r}")
    if not truth(holds):
        raise ClaimFailed(
            f"the notebook claims: {name!r}, but the measurement says otherwise"
            + (f" ({measured})" if measured else "")
            + ". Re-run the cell; if it still fails, the text around it needs rewriting."
        )


def say(text: str) -> None:
    """Show ``text`` (Markdown, usually an f-string of measured values) as the cell's output."""
    from IPython.display import Markdown, display

    if not isinstance(text, str):
        raise TypeError(f"say needs text to be a str (Markdown, e.g. an f-string), got {text!r}")
    display(Markdown(text))


def magnitude(x: float) -> str:
    """A positive number as a power of ten for prose: 6.2e5 -> '6 × 10⁵', 1.2e-3 -> '1 × 10⁻³'."""
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) and math.isfinite(x) and x > 0):
        raise ValueError(f"magnitude needs a finite positive number, got {x!r}")
    exponent = math.floor(math.log10(x))
    mantissa = round(x / 10**exponent)
    if mantissa == 10:
        mantissa, exponent = 1, exponent + 1
    superscript = str(exponent).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return f"{mantissa} × 10{superscript}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """A count with its noun for prose: plural(1, 'thread') -> '1 thread', plural(2, 'KV head') -> '2 KV heads'."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"plural needs an int count, got {n!r}")
    if not isinstance(word, str) or not (many is None or isinstance(many, str)):
        raise TypeError(f"plural needs word (and many, if given) to be str, got {word!r}, {many!r}")
    return f"{int(n):,} {word if n == 1 else (many or word + 's')}"
