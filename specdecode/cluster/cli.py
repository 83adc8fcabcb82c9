"""`specdecode serve ... --replicas N` / `python -m specdecode.cluster ...`: serve on Ray Serve.

With no `--ray-address` a local Ray instance is started, its ports on loopback (and shut down on exit: SIGINT
or SIGTERM leave no Ray process behind); with one, the application joins that cluster and is deleted from it on
exit, the cluster itself staying up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from specdecode.cli_args import cache_kwargs, speculative_config_from_args
from specdecode.cluster.config import ClusterConfig
from specdecode.cluster.routing import DEFAULT_PREFIX_CHARS
from specdecode.extras import missing_extra
from specdecode.server.serve_args import add_serve_subparser

logger = logging.getLogger("specdecode.cluster")
CLUSTER_FLAGS = ("replicas", "ray_address", "min_replicas", "max_replicas")
LOOPBACK = "127.0.0.1"
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's one-machine mode: its processes take 127.0.0.1 as the node's address and bind their ports (GCS, raylet,
object manager, workers, dashboard agent) there, not on every interface; Ray reads it when imported, and on
Linux would otherwise resolve even `_node_ip_address="127.0.0.1"` to the machine's routable address. The Serve
proxy binds `--host`; each Serve replica's inter-deployment gRPC server binds every interface (fixed in Ray
Serve: no option reaches it)."""


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (Ray Serve; needs the [cluster] extra)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve behind this endpoint (default: no Ray, one engine)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or ray://head:10001); default: start a local Ray")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many replicas ...")
    g.add_argument("--max-replicas", type=int, default=None, help="... to this many, on requests in flight")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of requests in flight per replica (default: --max-num-seqs)")
    g.add_argument("--replica-threads", type=int, default=1, help="CPU threads (and Ray CPUs) per replica")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (fractions allowed)")
    g.add_argument("--route-prefix-chars", type=int, default=DEFAULT_PREFIX_CHARS,
                   help="characters of the conversation prefix that pin a conversation to a replica")
    g.add_argument("--route-saturation", type=int, default=None,
                   help="requests in flight at which a conversation's replica is passed over for the least "
                        "loaded one (default: --max-num-seqs)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests held for a replica slot while every replica is full; beyond it a 429 with "
                        "Retry-After (default: --max-waiting)")
    g.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of a local Ray instance (default: the machine's, at least the replicas' need)")
    g.add_argument("--ray-object-store-mb", type=int, default=256, help="object store of a local Ray instance")


def wants_cluster(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in CLUSTER_FLAGS)


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        speculative_config=speculative_config_from_args(args), quantization=args.quantization, seed=args.seed,
        max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting, served_model_name=args.served_model_name,
        api_key=args.api_key, default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
        replicas=args.replicas if args.replicas is not None else (args.min_replicas or 1),
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, replica_threads=args.replica_threads,
        replica_gpus=args.replica_gpus, route_prefix_chars=args.route_prefix_chars,
        route_saturation=args.route_saturation, drain_timeout_s=args.drain_timeout,
        max_queued_requests=args.max_queued_requests, **cache_kwargs(args),
    )


class ClusterServer:
    """Start (or join) Ray, deploy the application, and take it all down again."""

    def __init__(self, cfg: ClusterConfig, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                 num_cpus: int | None = None, object_store_mb: int = 256) -> None:
        self.cfg, self.host, self.port, self.ray_address = cfg, host, port, ray_address
        self.num_cpus, self.object_store_mb = num_cpus, object_store_mb
        self.owns_ray = False

    def start_ray(self) -> None:
        if self.ray_address is None:  # read when Ray is imported: set it first
            os.environ.update(LOCAL_RAY_ENV)
        try:
            import ray
            from ray import serve  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"--replicas needs Ray Serve: {missing_extra('cluster', exc)}") from None

        if self.ray_address is not None:
            ray.init(address=self.ray_address, log_to_driver=False)
        else:
            top = self.cfg.max_replicas if self.cfg.autoscaling else self.cfg.replicas
            need = max(1, top or 1) * self.cfg.replica_threads
            num_cpus = self.num_cpus if self.num_cpus is not None else max(need, os.cpu_count() or 1)
            # Workers inherit this process's environment (PYTHONPATH and LOCAL_RAY_ENV included) from the raylet.
            ray.init(address="local", num_cpus=num_cpus, object_store_memory=self.object_store_mb << 20,
                     _node_ip_address=LOOPBACK, include_dashboard=False, dashboard_host=LOOPBACK,
                     log_to_driver=False, configure_logging=False)
            self.owns_ray = True

    def deploy(self) -> None:
        from ray import serve

        from specdecode.cluster.deployment import build_application

        serve.start(http_options={"host": self.host, "port": self.port}, proxy_location="HeadOnly")
        serve.run(build_application(self.cfg), name=self.cfg.app_name, route_prefix="/", blocking=False)

    def start(self) -> ClusterServer:
        self.start_ray()
        self.deploy()
        return self

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self.owns_ray:
                serve.shutdown()
            else:
                serve.delete(self.cfg.app_name)
        except Exception:  # noqa: BLE001 - shut Ray down whatever Serve says
            logger.exception("Ray Serve shutdown failed")
        ray.shutdown()


def run_cluster(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    serving = False

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if not serving:  # still starting: leave serve.run() at once
            raise KeyboardInterrupt

    def install() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)

    install()
    server = ClusterServer(cfg, args.host, args.port, args.ray_address, args.ray_num_cpus, args.ray_object_store_mb)
    try:
        server.start_ray()
        install()  # ray.init() installs its own SIGTERM handler, which would end this process without cleanup
        server.deploy()
        serving = True
        if not stop.is_set():
            where = f"http://{args.host}:{args.port}"
            print(f"specdecode: serving {cfg.model} on {cfg.replicas} replica(s) at {where} "
                  f"(Ray {'at ' + args.ray_address if args.ray_address else 'local'})", file=sys.stderr, flush=True)
            print(json.dumps({"event": "ready", "url": where}), flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serving = True
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # a second signal must not interrupt the shutdown
        server.stop()
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
    print("specdecode: cluster stopped", file=sys.stderr, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdecode.cluster",
                                     description="specdecode serve on Ray Serve (same flags as `specdecode serve`)")
    sub = parser.add_subparsers(dest="command")
    add_cluster_args(add_serve_subparser(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    if args.replicas is None and args.min_replicas is None:
        args.replicas = 1
    try:
        return run_cluster(args)
    except ValueError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
