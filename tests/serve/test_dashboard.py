"""`deploy/`: the Grafana dashboard reads only metrics the server really exports (names taken
from a real app's `/metrics` text, histograms' and counters' sample suffixes included), every
query is filtered by the dashboard's `model_name`, and the Prometheus config parses."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from quart import Quart

from tests.serve.metrics_scrape import Scrape

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ds4jax.json"
PROMETHEUS = DEPLOY / "prometheus.yml"
METRIC = re.compile(r"ds4jax:[a-zA-Z0-9_:]+")
#: a metric and its label matcher, if any
SELECTOR = re.compile(r"(ds4jax:[a-zA-Z0-9_:]+)(\{[^}]*\})?")
FILTER = 'model_name="$model_name"'


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows (a collapsed row holds its own) included."""
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel's targets."""
    return [
        (p.get("title", ""), t["expr"])
        for p in panels(dashboard["panels"])
        for t in p.get("targets", [])
        if "expr" in t
    ]


def template_exprs(dashboard: dict[str, Any]) -> list[str]:
    """The queries of the templating variables that run one (not the data source picker)."""
    out = []
    for v in dashboard["templating"]["list"]:
        if v.get("type") != "query":
            continue
        query = v["query"]
        out.append(query["query"] if isinstance(query, dict) else query)
        if v.get("definition"):
            out.append(v["definition"])
    return out


def missing(exprs: list[str], exported: set[str]) -> set[str]:
    return {name for e in exprs for name in METRIC.findall(e)} - exported


@pytest.fixture
def exported(app: Quart) -> set[str]:
    names = Scrape.parse(app.metrics.render().decode()).names()  # type: ignore[attr-defined]
    assert "ds4jax:time_to_first_token_seconds_bucket" in names  # suffixes are there
    return names


def test_the_dashboard_loads_and_every_panel_has_a_title_and_a_query() -> None:
    d = load()
    assert d["schemaVersion"] >= 36
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model_name"} <= names
    every = list(panels(d["panels"]))
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert any(p.get("collapsed") and p["panels"] for p in every), "no nested row is checked"
    for p in every:
        assert p.get("title"), p
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def test_every_query_names_only_exported_metrics(exported: set[str]) -> None:
    d = load()
    exprs = [e for _, e in panel_exprs(d)]
    templates = template_exprs(d)
    assert len(exprs) > 40 and templates
    assert not missing(exprs + templates, exported)
    for title, e in panel_exprs(d):
        assert METRIC.search(e), f"{title}: no ds4jax: metric in {e}"
    # the model picker lists what the server labels its series with
    assert "ds4jax:requests_running" in exported
    assert templates[0] == "label_values(ds4jax:requests_running, model_name)"


def test_every_panel_query_is_filtered_by_the_model() -> None:
    for title, e in panel_exprs(load()):
        for name, matcher in SELECTOR.findall(e):
            assert FILTER in matcher, f"{title}: {name} without {FILTER} in {e}"


def test_a_made_up_metric_is_reported(exported: set[str]) -> None:
    """The check is not vacuous: one unknown name in a copy of the dashboard is caught."""
    d = copy.deepcopy(load())
    target = next(p for p in panels(d["panels"]) if p.get("targets"))["targets"][0]
    real = METRIC.search(target["expr"])
    assert real is not None
    target["expr"] = target["expr"].replace(real.group(), "ds4jax:no_such_metric", 1)
    assert missing([e for _, e in panel_exprs(d)], exported) == {"ds4jax:no_such_metric"}
    # and a histogram's family name without its sample suffix is no sample name either
    assert missing(["rate(ds4jax:time_to_first_token_seconds[1m])"], exported)


def test_the_prometheus_config_scrapes_the_local_server() -> None:
    text = PROMETHEUS.read_text()
    assert "authorization:" in text and "credentials" in text  # the --api-key example
    try:
        import yaml
    except ImportError:  # no PyYAML: the text checks below stand
        yaml = None
    if yaml is not None:
        config = yaml.safe_load(text)
        assert config["global"]["scrape_interval"] == "5s"
        (job,) = config["scrape_configs"]
        assert job["metrics_path"] == "/metrics"
        assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    else:
        assert "metrics_path: /metrics" in text and '"127.0.0.1:8000"' in text
