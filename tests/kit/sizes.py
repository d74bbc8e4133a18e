"""One property at two sizes: a quick one for ``make test``, the full one behind ``slow``.

``make test`` must stay under 5 minutes on 2 cores, so a property whose full run costs
seconds runs there with fewer hypothesis examples (or a smaller world), and the same
test code runs at its full size under the marker ``slow`` (``make test-slow``). No
property is left out of either: only the number of cases differs.

``at_two_sizes`` takes the place of ``@settings(max_examples=...)`` and ``@given(...)``::

    @at_two_sizes(given(st.lists(answers)), quick=50, full=300, deadline=None)
    def test_each_answer_reads_as_decoded_whole(sequence): ...

The decorated name is the quick test; a copy named ``<name>_full``, marked ``slow``, is
put beside it in the module (where pytest collects it). pytest marks such as
``parametrize`` go UNDER this decorator, so that both sizes carry them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings

Test = Callable[..., None]


def at_two_sizes(
    given: Callable[[Test], Test], quick: int, full: int, **options: Any
) -> Callable[[Test], Test]:
    """``given``: the ``hypothesis.given(...)`` decorator of the test; ``quick`` and
    ``full``: its ``max_examples`` in ``make test`` and under ``slow``; ``options``: the
    other ``settings`` (``deadline``, ``suppress_health_check``, ...)."""
    if not 0 < quick < full:
        raise ValueError(f"quick ({quick}) must be fewer examples than full ({full})")

    def decorate(test: Test) -> Test:
        def sized(examples: int) -> Test:
            return settings(max_examples=examples, **options)(given(test))

        whole = pytest.mark.slow(sized(full))
        whole.__name__ = f"{test.__name__}_full"
        whole.__qualname__ = f"{test.__qualname__}_full"
        if whole.__name__ in test.__globals__:
            raise ValueError(f"{whole.__name__} is already defined in {test.__module__}")
        test.__globals__[whole.__name__] = whole
        return sized(quick)

    return decorate
