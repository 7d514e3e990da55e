"""flows/schedule.yaml is the home of the scheduled deployment (its name, cron, timezone and flow
parameters, read by ``python -m flows.deploy``); prefect.yaml, which ``prefect deploy`` reads and
which cannot include another file, repeats them, and this test holds the two equal. No server."""

from __future__ import annotations

import yaml

from flows.deploy import ENTRYPOINT, load_schedule

from .conftest import REPO


def test_prefect_yaml_deploys_what_flows_schedule_yaml_says():
    cfg = load_schedule(REPO / "flows" / "schedule.yaml")
    (dep,) = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    assert dep["name"] == cfg["name"]
    assert dep["schedules"] == [{"cron": cfg["cron"], "timezone": cfg.get("timezone", "UTC")}]
    assert (dep.get("parameters") or {}) == (cfg.get("parameters") or {})
    assert dep["entrypoint"] == ENTRYPOINT

