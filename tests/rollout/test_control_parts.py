"""The client's parts alone: a `ControlPlane` and the `WeightCalls` over it, built without an `SGLangClient` (URLs
and an HTTP session are all they need), against the fault server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp

from slime_corr.rollout.control import ControlPlane
from slime_corr.rollout.weight_calls import WeightCalls

from .fault_server import run_fault_server


def test_a_control_plane_and_its_weight_calls_work_without_a_client():
    with run_fault_server(mode="ok") as (url, server):
        async def go():
            async with aiohttp.ClientSession() as session:
                control = ControlPlane([url], lambda: session, timeout=10.0)
                weights = WeightCalls(control)
                healthy = await control.health()
                await control.pause("retract")
                held = control.gate.held  # its own gate holds back requests until the continue
                await control.continue_generation()
                await weights.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g",
                                                              weight_version="step-1")
                return healthy, held, control.gate.held, await control.weight_versions()

        healthy, held, held_after, versions = asyncio.run(go())
    assert healthy and held and not held_after
    assert versions == {url: "step-1"}
    assert [path for path, _ in server.calls] == [
        "/pause_generation", "/continue_generation", "/update_weights_from_distributed",
        "/get_model_info",  # the update's check of the version it names
        "/get_model_info"]
    assert server.calls[0][1] == {"mode": "retract"} and server.calls[2][1]["group_name"] == "g"
