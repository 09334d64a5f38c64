"""Reading `/metrics` as Prometheus does: the text parsed by prometheus_client's own parser,
samples looked up by name and a subset of their labels."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    families: dict[str, str]  # family name → type

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples, families = {}, {}
        for family in text_string_to_metric_families(text):
            families[family.name] = family.type
            for s in family.samples:
                key = (s.name, frozenset(s.labels.items()))
                assert key not in samples, f"sample {key} twice"
                samples[key] = s.value
        return cls(samples, families)

    def get(self, name: str, **labels: str) -> float:
        """The sum over the samples named `name` whose labels include `labels` (0: none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def names(self) -> set[str]:
        """Every sample name the text can carry: histograms' `_bucket`/`_sum`/`_count`, a
        counter's `_total`, an info's `_info`, even before a first sample."""
        out = {n for n, _ in self.samples}
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "info": ("_info",), "gauge": ("",)}  # fmt: skip
        for family, kind in self.families.items():
            out |= {family + s for s in suffixes.get(kind, ("",))}
        return out

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        return self.get(name, **labels) - before.get(name, **labels)


def scrape(url: str, api_key: str | None = None) -> Scrape:
    req = urllib.request.Request(url + "/metrics")
    if api_key is not None:
        req.add_header("x-api-key", api_key)
    with urllib.request.urlopen(req) as r:
        return Scrape.parse(r.read().decode())
