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



def test_the_entrypoint_is_a_flow_that_takes_the_schedule_parameters():
    """Prefect finds the flow in the entrypoint's source without running it (as ``prefect deploy`` does for the
    parameter schema), and every parameter the schedule sets is one of the flow's."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    path, name = ENTRYPOINT.split(":")
    schema = parameter_schema_from_entrypoint(f"{REPO / path}:{name}")
    assert {"workdir", "overrides", "experiment_name", "stages", "stage_timeout_s"} == set(schema.properties)
    assert set(load_schedule(REPO / "flows" / "schedule.yaml").get("parameters") or {}) <= set(schema.properties)
