"""How often a local function's server may end on its own before the gateway stops starting it again: the
crash window, the backoff between restarts, and what `pkg ps` says about a crash loop (supervise.py acts on
it; inventory.py reports it)."""

from __future__ import annotations

from packager.targets.local.records import LocalDeployment

CRASH_WINDOW = 60.0
CRASHLOOP_CRASHES = 5
BACKOFF_FIRST = 0.5  # seconds before the second restart in a window; the first is at once
BACKOFF_MAX = 8.0


def recent(deployment: LocalDeployment, now: float) -> tuple[float, ...]:
    return tuple(t for t in deployment.crashes if now - t < CRASH_WINDOW)


def backoff(deployment: LocalDeployment, now: float) -> float:
    """Seconds to wait before starting it again: none after its first crash in the window, then doubling."""
    crashes = len(recent(deployment, now))
    return 0.0 if crashes <= 1 else min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (crashes - 2))


def crashloop_left(deployment: LocalDeployment, now: float) -> float:
    """Seconds until a crashlooping function may be tried again; 0 when it is not in a crash loop (any more)."""
    if deployment.crashloop_since is None:
        return 0.0
    crashes = recent(deployment, now)
    if len(crashes) < CRASHLOOP_CRASHES:
        return 0.0
    return max(0.0, crashes[-CRASHLOOP_CRASHES] + CRASH_WINDOW - now)


def describe(deployment: LocalDeployment, now: float) -> str:
    """`pkg ps`'s reason for a function in a crash loop."""
    left = crashloop_left(deployment, now)
    retry = f"in {left:.0f} s the next request tries once more" if left > 0 else "the next request tries once more"
    return (
        f"its server ended {len(deployment.crashes)} times within {CRASH_WINDOW:.0f} s, last: "
        f"{deployment.crash_reason}; the gateway stopped starting it again: fix the cause and redeploy "
        f"(pkg deploy {deployment.function_dir}); {retry}"
    )
