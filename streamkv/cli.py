"""Command line: ``streamkv generate ...``; engine flags come from the config dataclasses."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from typing import Any, Sequence

from streamkv.config import EngineConfig
from streamkv.errors import StreamKVError


def _flag_type(field: dataclasses.Field) -> Any:  # type: ignore[type-arg]
    text = str(field.type)
    if "bool" in text:
        return "bool"
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


_CHOICES = re.compile(r"^([\w.-]+(?: \| [\w.-]+)+)")


def _default_text(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    value = f.default if f.default is not dataclasses.MISSING else None
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    unit = f.metadata.get("unit")
    if unit == "BYTES" and isinstance(value, int) and value >= 1 << 20:
        return f"{value} ({value / (1 << 20):g} MiB)" if value < 1 << 30 else f"{value} ({value / (1 << 30):g} GiB)"
    return str(value)


def flag_help(f: dataclasses.Field) -> tuple[str, str | None]:  # type: ignore[type-arg]
    """``(help, metavar)`` of a config field: its help with the default appended (unless the
    help states it), and its unit (``BYTES``, ``SECONDS``, ``TOKENS``...) or its choices."""
    helptext = f.metadata.get("help", "")
    if "default" not in helptext:
        helptext += f" (default: {_default_text(f)})"
    choices = _CHOICES.match(f.metadata.get("help", ""))
    metavar = f.metadata.get("unit") or ("{" + choices.group(1).replace(" | ", ",") + "}" if choices else None)
    return helptext, metavar


def _add_dataclass_flags(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(f)
        helptext, metavar = flag_help(f)
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=helptext)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=helptext,
                               metavar=metavar)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field (``kv_cache_memory`` -> ``--kv-cache-memory``)."""
    for section in dataclasses.fields(EngineConfig):
        _add_dataclass_flags(parser, section.name, type(section.default_factory()))  # type: ignore[misc]


def _options(args: argparse.Namespace, classes: list[type]) -> dict[str, Any]:
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return _options(args, [type(s.default_factory()) for s in dataclasses.fields(EngineConfig)])  # type: ignore[misc]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    add_engine_flags(gen)
    info = sub.add_parser("info", help="the machine, the native kernels and the kernel choice for a model "
                                       "(measured and cached at first start)")
    info.add_argument("--retune", action="store_true", help="measure the kernel candidates again")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_engine_flags(info)
    prof = sub.add_parser("profile", help="measure the preemption cost profile (prefill time by tokens, swap "
                                          "time by blocks) and cache it for --preemption cost")
    prof.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_engine_flags(prof)
    from streamkv.cluster.config import ClusterConfig
    from streamkv.server.config import ServerConfig

    serve = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible HTTP API")
    _add_dataclass_flags(serve, "server", ServerConfig)
    _add_dataclass_flags(serve, "cluster", ClusterConfig)
    add_engine_flags(serve)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from streamkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    llm = LLM(show_progress=sys.stderr.isatty(), **engine_options(args))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import json

    from streamkv.engine.info import machine_and_kernels, render

    report = machine_and_kernels(EngineConfig.from_flat(**engine_options(args)), retune=args.retune)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from streamkv.engine.engine import Engine
    from streamkv.engine.profile import BESIDE_LOAD, load_or_measure, make_room, profile_path
    from streamkv.native.cpu import cpu_model

    options = engine_options(args)
    options["preemption"] = "recompute"  # measure below, not at start
    engine = Engine(EngineConfig.from_flat(**options))
    if "swap_space" not in options:
        make_room(engine)  # room to time the largest swaps, whatever a block's size
    profile = load_or_measure(engine, remeasure=True, quick=False)
    report = {"cpu": cpu_model(), "path": str(profile_path(engine)), "cached": profile.source != BESIDE_LOAD,
              **profile.to_dict()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"cpu: {report['cpu']}\nprofile: {report['path']}" +
          ("" if report["cached"] else " (not cached: measured beside other load; run again when quiet)"))
    for n, t in profile.prefill:
        print(f"  prefill {n:>5} tokens  {t * 1e3:9.2f} ms  ({n / t:,.0f} tok/s)")
    for (n, t_out), (_, t_in) in zip(profile.swap_out, profile.swap_in):
        print(f"  swap    {n:>5} blocks  out {t_out * 1e3:7.3f} ms  in {t_in * 1e3:7.3f} ms")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from streamkv.cluster.config import ClusterConfig
    from streamkv.server.config import ServerConfig
    from streamkv.server.run import serve

    logging.getLogger("streamkv").setLevel(logging.INFO)
    config = ServerConfig(**_options(args, [ServerConfig]))
    cluster = ClusterConfig(**_options(args, [ClusterConfig]))
    if cluster.replicas == 0:
        return serve(EngineConfig.from_flat(**engine_options(args)), config)
    try:
        from streamkv.cluster import serve_app
    except ImportError as exc:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'streamkv[cluster]' ({exc})") from None
    options = engine_options(args)
    EngineConfig.from_flat(**options)  # bad flags fail here, not in every replica
    return serve_app.run(cluster, options, config)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": cmd_generate, "serve": cmd_serve, "info": cmd_info, "profile": cmd_profile}
        return commands[args.command](args)
    except (StreamKVError, ValueError) as exc:
        print(f"streamkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
