"""The Ray fleet's driver for test_ray.py, in a process of its own.

Ray leaves its C++ threads running in a driver after ``ray.shutdown()`` until the process exits
(measured: gRPC's event engine and timers, the GCS client's io service, the core worker's io
thread; Serve's router loop too), so the pytest process that was the driver exited with them
running, a race with their libraries' static destructors. Here the driver is this short-lived
process: ``python -m tests.server.ray_driver '<json>'`` deploys the fleet (``deploy``'s
arguments in the JSON), replies with how to join the cluster (GCS address, auth env), then
answers each stdin line - ``stats`` (every replica's stats) or ``quit`` (shut the fleet down
and exit) - with one ``REPLY <json>`` line.
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = "REPLY "


def _reply(obj) -> None:
    print(PREFIX + json.dumps(obj), flush=True)


def main(argv: list[str]) -> int:
    import ray

    from tinyserve_trt.runtime.server import ServerConfig
    from tinyserve_trt.runtime.server.ray_app import ScaleConfig, deploy, shutdown

    args = json.loads(argv[0])
    handle = deploy(args["model_dir"], ServerConfig(**args["config"]), ScaleConfig(**args["scale"]), args["engine"],
                    warmup=args["warmup"], num_cpus=args["num_cpus"])
    try:
        # how to join: the address, and Ray's token auth mode (ray.init set it for its children)
        _reply({"gcs_address": ray.get_runtime_context().gcs_address,
                "env": {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")}})
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            try:
                _reply({"stats": handle.stats.remote().result(timeout_s=60)})
            except Exception as e:  # noqa: BLE001 - e.g. a call to a replica that just died: the test retries
                _reply({"error": repr(e)})
    finally:
        shutdown()
        _reply("BYE")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
