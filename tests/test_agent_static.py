"""The static check and the reply parser: pure functions, no process started."""

from __future__ import annotations

import pytest

from specpilot.agent.parse import PARAMS, SOURCE, ParseError, parse_reply
from specpilot.agent.static import StaticReject, check_source

from . import agent_sources as src


@pytest.mark.parametrize("name", list(src.STATIC_BAD))
def test_malicious_sources_are_rejected_with_the_reason(name: str) -> None:
    source, why = src.STATIC_BAD[name]
    with pytest.raises(StaticReject) as e:
        check_source(source, frozenset({"chain_length"}))
    assert why in str(e.value)


def test_good_sources_pass_and_are_described_statically() -> None:
    (good,) = check_source(src.GOOD)
    assert (good.id, good.factor, good.class_name, good.wraps_decode) == (
        "agent_unslow", "kernel", "Unslow", False,
    )  # fmt: skip
    (flip,) = check_source(src.CHANGE_OUTPUTS)  # changing outputs is forcing's job
    assert flip.wraps_decode and flip.id == "agent_flip"
    check_source(src.SPIN)  # so is spinning (the trial's deadline)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda s: s + "\nwhile True:\n    pass\n", "module-level While"),
        (lambda s: s.replace("MECHANISMS = [Unslow()]", ""), "no MECHANISMS"),
        (lambda s: s.replace("MECHANISMS = [Unslow()]", "MECHANISMS = [len]"), "instances"),
        (lambda s: s.replace('factor = "kernel"', 'factor = "speed"'), "not one of"),
        (lambda s: s.replace("def applicable", "def applies"), "missing method(s) ['applicable']"),
        (lambda s: s.replace('id = "agent_unslow"', "id = NAME"), "must be a string literal"),
        (lambda s: s.replace("class Unslow:", "class Unslow(Plan):"), "may only inherit"),
        (lambda s: s.replace("return ()", "return vars()"), "forbidden name 'vars'"),
        (lambda s: s.replace("return ()", "return '__'"), "strings containing '__'"),
        (lambda s: s.replace("return ()", "return '{0.x}'.format(1)"), "attribute 'format'"),
        (lambda s: s + "\ndef g():\n    global MECHANISMS\n", "global/nonlocal"),
        (lambda s: "x = (\n", "does not parse"),
        (lambda s: "", "empty"),
        (lambda s: "from specpilot.plan import load_plan\n" + s, "importing 'load_plan'"),
        (lambda s: "import dataclasses\n" + s, "import of 'dataclasses'"),
        (lambda s: "from .base import Param\n" + s, "import from"),
    ],
)
def test_protocol_and_name_rules(edit, why: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StaticReject) as e:
        check_source(edit(src.GOOD))
    assert why in str(e.value)


def test_taken_ids_and_the_relaxed_test_mode() -> None:
    with pytest.raises(StaticReject, match="already taken"):
        check_source(src.GOOD, frozenset({"agent_unslow"}))
    socket_src, _ = src.STATIC_BAD["socket"]
    assert check_source(socket_src, relaxed=True)[0].id == "agent_phone"  # names not checked
    with pytest.raises(StaticReject, match="no MECHANISMS"):  # the protocol still is
        check_source("import socket\n", relaxed=True)


def test_parse_params_and_source_replies() -> None:
    p = parse_reply(
        'Longer chains.\n```json\n{"mechanism": "chain_length", "params": {"k": 7}}\n```'
    )
    assert (p.kind, p.mechanism, p.params, p.note) == (PARAMS, "chain_length", {"k": 7},
                                                        "Longer chains.")  # fmt: skip
    bare = parse_reply('{"mechanism": "static_tree", "params": {"width": 3}}')
    assert (bare.kind, bare.params) == (PARAMS, {"width": 3})
    s = parse_reply(src.reply(src.GOOD) + '```json\n{"params": {"x": 1}}\n```')
    assert s.kind == SOURCE and s.source == src.GOOD.strip() + "\n" and s.params == {"x": 1}
    unlabelled = parse_reply("```\n" + src.GOOD + "```")
    assert unlabelled.kind == SOURCE


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty reply"),
        ("   \n", "empty reply"),
        ("Use a longer chain.", "no proposal found"),
        ('```json\n{"k": 7}\n```', "needs"),
        ("```python\nx = 1\n```\n```python\ny = 2\n```", "several python blocks"),
    ],
)
def test_parse_rejects_with_reasons(text: str, why: str) -> None:
    with pytest.raises(ParseError, match=why):
        parse_reply(text)
