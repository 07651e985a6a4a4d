"""The ``specserve`` command line: a module per command group (``generate``; ``serve``: up, status,
policy, routes, down; ``models``; ``bench``; ``zoo``), assembled here."""

from __future__ import annotations

import os
import sys

import typer

# Nothing in specserve may reach a model hub; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray 2.60 reads its authentication mode once, when ray is first imported; specserve's clusters
# keep Ray's token authentication on.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from specserve.cli.bench import bench_app  # noqa: E402 - the commands import models lazily, after the above
from specserve.cli.generate import generate  # noqa: E402
from specserve.cli.models import models_app  # noqa: E402
from specserve.cli.serve import down, policy, routes, status, up  # noqa: E402
from specserve.cli.zoo import zoo_app  # noqa: E402

app = typer.Typer(
    help="specserve: speculative-decoding LLM serving on Ray Serve.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
app.add_typer(zoo_app, name="zoo")
for command in (generate, up, status, policy, routes, down):
    app.command()(command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
