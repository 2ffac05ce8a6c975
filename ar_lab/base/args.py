"""Argument checks every layer shares: whole numbers, finite numbers and seeds, with messages that
name the argument and say what to pass. Each public function checks what a user hands it here, once;
internal calls trust their inputs. ``name`` is how the message names the value; ``arg`` (default:
``name``) is the argument the error carries (``ar_lab.base.errors``) when the message says more than
its name."""

from __future__ import annotations

import math
import numbers

from ar_lab.base.errors import BadValue


def positive_int(name: str, value, minimum: int = 1, *, arg: str | None = None) -> int:
    """``value`` as an int if it is a whole number (an int or a numpy integer, not a bool) >=
    ``minimum``; else a BadValue (a ValueError) naming ``name``. The one rule for counts:
    ``SamplingParams.top_k`` takes the same."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise BadValue(f"{name} must be an int >= {minimum}, got {value!r}", arg=arg or name)
    return int(value)


def finite_number(
    name: str, value, *, minimum: float = 0.0, above: bool = False, arg: str | None = None
) -> float:
    """``value`` as a float if it is a finite real number >= ``minimum`` (> with ``above``); else a
    BadValue naming ``name`` (NaN, infinity, text and bools are refused)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not real or (value <= minimum if above else value < minimum):
        bound = f"{'>' if above else '>='} {minimum:g}"
        raise BadValue(f"{name} must be {bound} (a finite number), got {value!r}", arg=arg or name)
    return float(value)


SEED_MAX = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def check_seed(seed, name: str = "seed", *, arg: str | None = None) -> int:
    """``seed`` if it is a whole number torch can seed a generator with (0 .. 2**64 - 1)."""
    if (
        not isinstance(seed, numbers.Integral)
        or isinstance(seed, bool)
        or not 0 <= seed <= SEED_MAX
    ):
        raise BadValue(
            f"{name} must be a whole number from 0 to 2**64 - 1, got {seed!r}", arg=arg or name
        )
    return int(seed)
