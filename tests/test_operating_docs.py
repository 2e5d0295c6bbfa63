"""docs/operating.md's alert rules and the Grafana dashboard name only series kvcached exposes.

An alert on a misspelt series never fires and a panel on one stays empty, silently; this test
reads both as Prometheus and Grafana would (the rules' YAML block, the dashboard's JSON) and
checks every ``vllm:kvcached_*`` name in them against the collector's table, the one place the
names are made (``kvcached.vllm.api_server.metrics.SERIES``), and that the alerts operators need
exist: the first violation, events dropped, a shrink waiting more than 10 minutes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvcached.vllm.api_server import metrics

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"vllm:kvcached_[a-z_]+")


def _rules() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text[text.index("### Alert rules") :]
    block = section[section.index("```yaml\n") + 8 :]
    doc = yaml.safe_load(block[: block.index("```")])
    (group,) = doc["groups"]
    rules: list[dict[str, Any]] = group["rules"]
    return rules


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_alert_rules_parse_and_cover_what_an_operator_is_paged_for() -> None:
    rules = {r["alert"]: r for r in _rules()}
    assert "increase(vllm:kvcached_violations_total" in rules["KvcachedInvariantViolation"]["expr"]
    assert "vllm:kvcached_events_dropped_total" in rules["KvcachedEventsDropped"]["expr"]
    stuck = rules["KvcachedShrinkStuck"]
    assert "vllm:kvcached_shrink_pending" in stuck["expr"] and stuck["for"] == "10m"
    # A killed engine core takes its API servers down: the scrape target's own up, not engine_up.
    assert rules["KvcachedServerDown"]["expr"].startswith("up{")
    assert "vllm:kvcached_budget_wanted_bytes" in rules["KvcachedBudgetShort"]["expr"]
    for r in rules.values():
        assert set(NAME.findall(r["expr"])) <= metrics.exposed_names(), r["expr"]


def test_the_dashboard_names_only_exposed_series_and_has_the_panels_asked_for() -> None:
    board = json.loads((ROOT / "docs" / "grafana" / "kvcached.json").read_text())
    exprs = _exprs(board)
    used = {n for e in exprs for n in NAME.findall(e)}
    assert used <= metrics.exposed_names(), used - metrics.exposed_names()
    titles = " | ".join(p["title"].lower() for p in board["panels"])
    for words in ("mapped, limit, capacity", "stacked by budget", "pins by kind", "violations"):
        assert words in titles, words
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    # The budget panel stacks and joins the budget label from the info series.
    (budget,) = [p for p in board["panels"] if "budget" in p["title"]]
    assert budget["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert any("group_left (budget) vllm:kvcached_info" in t["expr"] for t in budget["targets"])


def test_the_series_table_in_the_docs_is_the_collector_s() -> None:
    text = (ROOT / "docs" / "operating.md").read_text()
    table = text[text.index("| Series |") : text.index("### Alert rules")]
    documented = set(re.findall(r"^\| `(vllm:kvcached_[a-z_]+)`", table, re.M))
    assert documented == metrics.documented_names()
