"""Reading compiled HLO text in tests: its computations, and what a while loop runs."""

from __future__ import annotations

import re

_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|"
                    r"true_computation|false_computation)=\{?([^}\s,]+(?:,\s*%?[\w.\-]+)*)")


def computations(hlo: str) -> dict[str, str]:
    """Every computation of an HLO module by name (without the ``%``), with its text."""
    blocks = re.split(r"\n(?=\S)", hlo)
    named = (re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)[ (]", b) for b in blocks)
    return {m.group(1): b for m, b in zip(named, blocks) if m}


def loop_bodies(hlo: str, within: str | None = None) -> list[str]:
    """The text of every while loop's body computation in an HLO module, or only of the
    loops ``within`` that text (e.g. the entry computation: the outermost loops)."""
    by_name = computations(hlo)
    return [by_name[n] for n in re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", within or hlo)]


def entry(hlo: str) -> str:
    """The text of the module's entry computation."""
    return next(text for text in computations(hlo).values() if text.startswith("ENTRY"))


def with_callees(hlo: str, texts: list[str]) -> list[str]:
    """``texts`` (computations of ``hlo``) and every computation they call, transitively:
    what runs when they run (loop bodies, conditional branches, reductions, fusions)."""
    by_name = computations(hlo)
    seen: dict[str, str] = {}
    todo = list(texts)
    while todo:
        text = todo.pop()
        for group in _CALLS.findall(text):
            for name in re.findall(r"%?([\w.\-]+)", group):
                if name in by_name and name not in seen:
                    seen[name] = by_name[name]
                    todo.append(by_name[name])
    return list(texts) + [t for t in seen.values() if t not in texts]


def model_loops(hlo: str, within: str | None = None) -> list[str]:
    """``loop_bodies`` that multiply matrices (with what they call): a layer or tick loop
    does; the loops XLA:CPU's older fusion emitters expand a scatter into do not."""
    return [body for body in loop_bodies(hlo, within)
            if any(re.search(r"\b(dot|convolution)\(", text)
                   for text in with_callees(hlo, [body]))]
