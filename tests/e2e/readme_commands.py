"""The README's install and uninstall commands, and the e2e scenario that runs each (issue
39's Proof: "the README's install section is what the e2e does, command for command").

README.md's "Deploy" marks each code block the e2e runs with :data:`MARKER` (an HTML
comment on the line above it, invisible on the rendered page). Every command of those
blocks (one line, its ``# comment`` dropped, split at ``&&``, whitespace as shlex splits
it) is a key of :data:`COMMANDS`, which names the tests that run it and what they put in
place of the README's placeholders (:data:`PLACEHOLDERS`) or add to it (each addition
TEST ONLY, forced by the e2e machine: e2e/README.md, "The DaemonSet as shipped" and
"The chart and kubectl gpushare install as shipped").

``tests/deploy/test_readme_commands.py`` (``make test``) fails when the README gains,
loses or changes a command the table does not hold, or the table names a test that does
not exist; test_chart_real.py takes its commands from the README through :func:`argv`,
which refuses a command that is not there. test_daemonset_real.py runs the `kubectl
apply -k` line through its TEST-ONLY overlay of ``daemonset/`` (its own file, written
before this table), so the table says that substitution in words.

Imports nothing of the harness: the fast suite loads this file by its path.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: The comment above each README block the e2e runs.
MARKER = "<!-- e2e: the e2e runs each command of this block"

#: The README's placeholders, and what the e2e puts in their place.
PLACEHOLDERS = {
    "REF": "the image's reference as imported into the node's containerd "
    "(docker.io/library/gpushare:<version>: `make image-archive STANDINS=all` names it "
    "gpushare:<version>)",
    "REGISTRY": "docker.io/library (REF without /gpushare:<version>)",
    "gpu-node-1": "the e2e node's name (node-1)",
}


@dataclass(frozen=True)
class Runs:
    """Who runs a README command: ``tests`` as ``<file>::<test or fixture>`` under
    tests/e2e/, and ``how``: the placeholders filled and what is added (TEST ONLY)."""

    tests: tuple[str, ...]
    how: str


_CHART = "test_chart_real.py"
_SHIPPED = "test_daemonset_real.py"
_HELM_INSTALL = (
    "helm install gpushare charts/gpushare -n kube-system --set image.repository=REGISTRY/gpushare"
)

#: Every command of the README's marked blocks, exactly as :func:`readme_commands` gives it.
COMMANDS: dict[str, Runs] = {
    "kubectl gpushare install --node gpu-node-1 --image REF": Runs(
        (f"{_CHART}::test_kubectl_gpushare_install_runs_the_daemon_on_the_real_runtime",),
        "REF and gpu-node-1 filled; then (TEST ONLY) `kubectl -n kube-system patch "
        "daemonset/gpushare --type=json`: hostNetwork, KUBERNETES_SERVICE_HOST/PORT at the "
        "API server, a free metrics port on 127.0.0.1, GPUSHARE_SIMULATE",
    ),
    "kubectl apply -k daemonset/": Runs(
        (f"{_SHIPPED}::shipped",),
        "daemonset/ replaced by its TEST-ONLY overlay (resources: daemonset/; hostNetwork, "
        "KUBERNETES_SERVICE_HOST/PORT, a free metrics port on 127.0.0.1), then `kubectl set "
        "env GPUSHARE_SIMULATE`; the manifest's image gpushare:<version> is REF as imported, "
        "so it needs no edit",
    ),
    "kubectl label node gpu-node-1 gpushare.io/enabled=true": Runs(
        (
            f"{_SHIPPED}::shipped",
            f"{_CHART}::test_helm_install_runs_the_daemon_on_the_real_runtime",
        ),
        "gpu-node-1 filled",
    ),
    _HELM_INSTALL: Runs(
        (f"{_CHART}::test_helm_install_runs_the_daemon_on_the_real_runtime",),
        "REGISTRY filled; `-f <values>` added (TEST ONLY): hostNetwork: true, extraEnv "
        "KUBERNETES_SERVICE_HOST/PORT at the API server, config.simulate, "
        "config.metricsPort a free port",
    ),
    "kubectl gpushare uninstall --all": Runs(
        (
            f"{_SHIPPED}::test_uninstall_leaves_nothing_in_the_cluster_and_no_socket_or_spec_on_the_node",
            f"{_CHART}::test_helm_uninstall_leaves_nothing_of_gpushare",
            f"{_CHART}::test_kubectl_gpushare_uninstall_leaves_nothing_of_gpushare",
        ),
        "as written (test_daemonset_real.py adds --wait 120)",
    ),
    "kubectl delete -k daemonset/": Runs(
        (
            f"{_SHIPPED}::test_uninstall_leaves_nothing_in_the_cluster_and_no_socket_or_spec_on_the_node",
        ),
        "daemonset/ replaced by the TEST-ONLY overlay that was applied; --wait=true added",
    ),
    "helm uninstall gpushare -n kube-system": Runs(
        (f"{_CHART}::test_helm_uninstall_leaves_nothing_of_gpushare",), "as written"
    ),
}


class ReadmeFormatError(ValueError):
    """A marked README block that cannot be read (no block under the marker, no end)."""


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of README.md's marked blocks (or of ``text``), in order, duplicates
    kept: each line without its comment, split at ``&&``, its words joined by one space."""
    lines = (README.read_text() if text is None else text).splitlines()
    commands: list[str] = []
    index = 0
    while index < len(lines):
        if not lines[index].startswith(MARKER):
            index += 1
            continue
        if index + 1 >= len(lines) or not lines[index + 1].startswith("```"):
            raise ReadmeFormatError(f"README line {index + 1}: the marker is not above a block")
        index += 2
        while index < len(lines) and not lines[index].startswith("```"):
            commands += _split(lines[index])
            index += 1
        if index >= len(lines):
            raise ReadmeFormatError("a marked README block does not end")
    return commands


def _split(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    commands: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return [" ".join(command) for command in commands if command]


def argv(command: str, places: dict[str, str]) -> list[str]:
    """The README's ``command`` as argv, each placeholder (a key of ``places``, those of
    :data:`PLACEHOLDERS`) replaced by its value; a LookupError when the README does not hold
    ``command`` now (the e2e runs what the README says, nothing else)."""
    if command not in readme_commands():
        raise LookupError(f"not a command of README.md's marked Deploy blocks: {command!r}")
    words = command.split(" ")
    for placeholder, value in places.items():
        words = [word.replace(placeholder, value) for word in words]
    return words
