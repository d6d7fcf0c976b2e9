"""`pkg adapter add|remove|list FUNCTION`: LoRA adapters on a running endpoint, without a rebuild or a redeploy.

`add` reads a PEFT folder or a GGUF LoRA file, checks it against the function's bundle (its graph must take
adapters: `[[adapters]]` or `[export] adapter_modules`), converts it into onnxfn's adapter file and sends it with
its digest:

- `--target local` (the default): to the local server (`PUT /v1/adapters/NAME`), which stores it in the function's
  state folder (`adapters/`, its `--adapter-dir`) and serves `model: "FUNCTION:NAME"` at once. A function the
  gateway stopped as idle gets the file in that folder, under the function's lock: its next start serves it.
- `--device URL[,URL…]` (`--target edge`): to each edge agent (`PUT /agent/adapters/NAME`, the push token), which
  checks the digest and hands it to the bundle it serves; it stays across bundle swaps.
- `--target aws-lambda|aws-sagemaker`: to the function's adapter store in its bucket (packager/targets/aws/adapters.py),
  which each execution environment or instance fetches and verifies when it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packager.adapters.client import AdapterClient, PreparedAdapter, bundle_layout, bundled_names, check_name, prepare
from packager.commands.push import add_device_arguments, tls_flags
from packager.edge.devices import EdgeOptions, edge_options
from packager.edge.fleet import DeviceResult, add_adapter, list_adapters, remove_adapter
from packager.edge.progress import DeviceProgress
from packager.errors import UserError
from packager.paths import bundle_dir
from packager.runtime_flags import adapter_dir_of
from packager.spec import FunctionSpec, load_spec
from runtime.adapters.catalog import AdapterCatalog
from runtime.adapters.files import SUFFIX, AdapterFileError
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import Manifest

console = Console()
err_console = Console(stderr=True)
AWS_TARGETS = ("aws-lambda", "aws-sagemaker")  # packager/targets/aws/adapters.py, imported when used
TARGETS = ("local", "edge", *AWS_TARGETS)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "adapter",
        help="add, remove or list LoRA adapters on a running endpoint (no redeploy)",
        description='Clients choose an adapter per request with model: "FUNCTION:NAME".',
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    add = actions.add_parser("add", help="convert an adapter and load it into the running endpoint")
    _common(add)
    add.add_argument("name", help='the adapter\'s name: clients send model: "FUNCTION:NAME"')
    add.add_argument("source", type=Path, help="a PEFT folder (adapter_config.json + safetensors) or a GGUF LoRA file")
    add.set_defaults(run=run_add)

    remove = actions.add_parser("remove", help="remove an adapter added with `pkg adapter add`")
    _common(remove)
    remove.add_argument("name", help="the adapter's name")
    remove.set_defaults(run=run_remove)

    listing = actions.add_parser("list", help="the adapters the endpoint serves (bundled and added)")
    _common(listing)
    listing.add_argument("--json", action="store_true", help="print the rows as JSON (for scripts)")
    listing.set_defaults(run=run_list)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument(
        "--target", choices=TARGETS, help="where the endpoint runs (default: edge with --device, else local)"
    )
    add_device_arguments(parser)


def _target(args: argparse.Namespace) -> str:
    chosen: str = args.target or ("edge" if args.device else "local")
    if chosen != "edge" and args.device:
        raise UserError(f"--device sends to edge agents: drop --target {chosen}, or drop --device", exit_code=2)
    return chosen


# ---- add -------------------------------------------------------------------------------------------------------


def run_add(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    check_name(args.name)
    if _target(args) == "edge":
        options = _edge(spec, args)
        manifest, layout = bundle_layout(bundle_dir(spec), spec.directory)
        prepared = _convert(args.name, args.source, manifest, layout)
        with DeviceProgress(console, options.devices) as progress:
            results = add_adapter(
                options.devices, prepared.name, prepared.data, prepared.digest, options.auth, progress.update
            )
        _device_table(f"adapter add {spec.name}:{prepared.name}", results, prepared)
        _say_model(spec, prepared.name)
        return _failures(results)
    if _target(args) in AWS_TARGETS:
        from packager.targets.aws import adapters as aws_adapters

        store = aws_adapters.AdapterStore.of(spec, _target(args))
        store.check_deployed()
        prepared = _convert(args.name, args.source, *bundle_layout(bundle_dir(spec), spec.directory))
        store.add(prepared)
        granted = store.grant_read()
        console.print(
            f"added adapter [bold]{prepared.name}[/] ({prepared.digest[:19]}…, {_mb(len(prepared.data))}) to "
            f"{store.where}" + ("" if granted else f" (no role {store.role} to give read access to yet)"),
            highlight=False,
        )
        console.print(aws_adapters.next_start(spec, store.target), highlight=False, markup=False)
        _say_model(spec, prepared.name)
        return 0
    local = _Local(spec)
    prepared = _convert(args.name, args.source, *local.layout())
    where = local.add(prepared)
    console.print(
        f"added adapter [bold]{prepared.name}[/] ({prepared.digest[:19]}…, {_mb(len(prepared.data))}, "
        f"rank {prepared.rank} on {', '.join(prepared.modules)}) to {spec.name}: {where}",
        highlight=False,
    )
    _say_model(spec, prepared.name)
    return 0


def _convert(name: str, source: Path, manifest: Manifest, layout: AdapterLayout) -> PreparedAdapter:
    with err_console.status(f"converting {source} for {manifest.function}"):
        return prepare(name, source, manifest, layout)


def _say_model(spec: FunctionSpec, name: str) -> None:
    console.print(f'clients choose it with model: "{spec.name}:{name}"', highlight=False, markup=False)


# ---- remove ----------------------------------------------------------------------------------------------------


def run_remove(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    check_name(args.name)
    if _target(args) == "edge":
        options = _edge(spec, args)
        results = remove_adapter(options.devices, args.name, options.auth)
        _device_table(f"adapter remove {spec.name}:{args.name}", results, None)
        return _failures(results)
    if _target(args) in AWS_TARGETS:
        from packager.targets.aws import adapters as aws_adapters

        store = aws_adapters.AdapterStore.of(spec, _target(args))
        store.remove(args.name)
        console.print(f"removed adapter [bold]{args.name}[/] from {store.where}", highlight=False)
        console.print(aws_adapters.next_start(spec, store.target), highlight=False, markup=False)
        return 0
    where = _Local(spec).remove(args.name)
    console.print(f"removed adapter [bold]{args.name}[/] from {spec.name}: {where}", highlight=False)
    return 0


# ---- list ------------------------------------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if _target(args) == "edge":
        options = _edge(spec, args)
        found = list_adapters(options.devices, options.auth)
        rows = [{"device": result.device, **row} for result, adapters in found for row in adapters]
        failed = [result for result, _ in found if not result.ok]
    elif _target(args) in AWS_TARGETS:
        from packager.targets.aws import adapters as aws_adapters

        manifest, _ = bundle_layout(bundle_dir(spec), spec.directory)
        bundled = [_bundled_row(spec, manifest, name) for name in bundled_names(manifest)]
        rows, failed = bundled + aws_adapters.rows(aws_adapters.AdapterStore.of(spec, _target(args))), []
    else:
        rows, failed = _Local(spec).adapters(), []
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _adapter_table(spec, rows, device=_target(args) == "edge")
    return _failures(failed) if failed else 0


def _adapter_table(spec: FunctionSpec, rows: list[dict[str, Any]], *, device: bool) -> None:
    if not rows:
        console.print(f"{spec.name} serves no adapters; add one: pkg adapter add {spec.directory} NAME SOURCE")
        return
    table = Table(title=f"{spec.name} adapters")
    columns = (["device"] if device else []) + ["name", "model", "bundled", "bytes", "digest", "resident"]
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column == "bytes" else "left")
    for row in rows:
        cells = [str(row["device"])] if device else []
        cells += [
            str(row.get("name", "")),
            str(row.get("id") or f"{spec.name}:{row.get('name', '')}"),
            "yes" if row.get("bundled") else "no",
            f"{int(row.get('bytes') or 0):,}",
            str(row.get("digest", ""))[:19],
            "[green]yes[/]" if row.get("resident") else "no",
        ]
        table.add_row(*cells)
    console.print(table)


# ---- edge ------------------------------------------------------------------------------------------------------


def _edge(spec: FunctionSpec, args: argparse.Namespace) -> EdgeOptions:
    return edge_options(spec.targets.edge, args.device, args.token_file, tls_flags(args))


def _device_table(title: str, results: list[DeviceResult], prepared: PreparedAdapter | None) -> None:
    table = Table(title=title)
    for column in ("device", "result", "digest", "sent", "seconds"):
        table.add_column(column, overflow="fold")
    for r in results:
        style = "green" if r.ok else "red"
        table.add_row(
            r.device,
            f"[{style}]{r.outcome}[/]",
            r.digest[:19] if r.digest else "-",
            _mb(r.sent) if r.sent else "-",
            f"{r.upload_seconds:.2f}" if r.upload_seconds else "-",
        )
    console.print(table)


def _failures(results: list[DeviceResult]) -> int:
    failed = [r for r in results if not r.ok]
    if failed:
        reasons = "\n".join(f"  - {r.device} ({r.outcome}): {r.detail}" for r in failed)
        raise UserError(f"{len(failed)} of {len(results)} device(s) failed:\n{reasons}")
    return 0


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


# ---- local -----------------------------------------------------------------------------------------------------


class _Local:
    """The function's local deployment: its running server's adapter API, or its adapter folder while idle."""

    def __init__(self, spec: FunctionSpec) -> None:
        from packager.targets.local import store

        self.spec = spec
        found = store.found(spec)
        if not found:
            raise UserError(
                f"{spec.name} is not deployed locally: deploy it first, then add adapters to it: "
                f"pkg deploy {spec.directory} --target local"
            )
        self.directory, deployment = found[0]
        self.bundle = Path(deployment.bundle)

    def layout(self) -> tuple[Manifest, AdapterLayout]:
        return bundle_layout(self.bundle, self.spec.directory)

    def add(self, prepared: PreparedAdapter) -> str:
        def running(client: AdapterClient) -> str:
            client.put(prepared.name, prepared.data, prepared.digest)
            return f"loaded by the running server ({client.url}), no restart"

        def idle(folder: Path, layout: AdapterLayout) -> str:
            try:
                AdapterCatalog(layout, [], folder).add(prepared.name, prepared.data, prepared.digest)
            except AdapterFileError as exc:
                raise UserError(str(exc)) from None
            return f"stored in {folder}; the server is idle and serves it when the next request wakes it"

        return self._with_server("adapter add", running, idle)

    def remove(self, name: str) -> str:
        manifest, _ = self.layout()

        def running(client: AdapterClient) -> str:
            client.delete(name)
            return f"the running server ({client.url}) no longer serves it"

        def idle(folder: Path, layout: AdapterLayout) -> str:
            if name in bundled_names(manifest):
                raise UserError(f"{name!r} is one of the bundle's adapters; remove it from function.toml and rebuild")
            path = folder / f"{name}{SUFFIX}"
            if not path.is_file():
                raise UserError(f"{self.spec.name} has no adapter {name!r}; {self._names_hint(folder, manifest)}")
            path.unlink()
            return f"deleted {path} (the server is idle)"

        return self._with_server("adapter remove", running, idle)

    def adapters(self) -> list[dict[str, Any]]:
        manifest, _ = self.layout()

        def running(client: AdapterClient) -> list[dict[str, Any]]:
            return client.adapters()

        def idle(folder: Path, layout: AdapterLayout) -> list[dict[str, Any]]:
            rows = [_bundled_row(self.spec, manifest, name) for name in bundled_names(manifest)]
            for path in sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []:
                name = path.name.removesuffix(SUFFIX)
                if name.startswith(".") or name in bundled_names(manifest):
                    continue
                rows.append(_row(self.spec, name, _file_digest(path), path.stat().st_size, bundled=False))
            return sorted(rows, key=lambda row: str(row["name"]))

        return self._with_server("adapter list", running, idle, lock=False)

    def _with_server(
        self,
        action: str,
        running: Callable[[AdapterClient], Any],
        idle: Callable[[Path, AdapterLayout], Any],
        *,
        lock: bool = True,
    ) -> Any:
        """`running(client)` when the server serves, `idle(adapter folder, layout)` when the gateway stopped it;
        under the function's lock (no deploy, destroy or idle stop meanwhile) unless `lock` is off."""
        from contextlib import nullcontext

        from packager.targets.local import inventory, store
        from packager.targets.local import lock as locks
        from packager.targets.local.records import ServerState

        def say(message: str) -> None:
            err_console.print(message, highlight=False)

        held = locks.held(self.directory, self.spec.name, action, say) if lock else nullcontext()
        with held:
            deployment = store.load(self.directory)
            if deployment is None:
                raise UserError(
                    f"{self.spec.name} was destroyed meanwhile; deploy it: pkg deploy {self.spec.directory}"
                )
            folder = adapter_dir_of(deployment.command)
            _, layout = self.layout()
            if folder is None:
                raise UserError(
                    f"the local server of {self.spec.name} was started without an adapter folder (deployed before "
                    f"its bundle took adapters, or by an older pkg); redeploy it: pkg deploy {self.spec.directory}"
                )
            state = inventory.observe(deployment).state
            if state is ServerState.IDLE:
                return idle(folder, layout)
            if state is not ServerState.READY:
                raise UserError(
                    f"the local server of {self.spec.name} is not serving (state: {state}, pid {deployment.pid}); "
                    f"`pkg status {self.spec.directory}` says why; redeploy: pkg deploy {self.spec.directory}"
                )
            key = deployment.api_key.read()
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            hint = f"is it running? `pkg status {self.spec.directory}`; deploy it: pkg deploy {self.spec.directory}"
            with AdapterClient(deployment.url, headers, down_hint=hint) as client:
                return running(client)

    def _names_hint(self, folder: Path, manifest: Manifest) -> str:
        names = bundled_names(manifest) + sorted(p.name.removesuffix(SUFFIX) for p in folder.glob(f"[!.]*{SUFFIX}"))
        return f"it has: {', '.join(names)}" if names else "it has none"


def _bundled_row(spec: FunctionSpec, manifest: Manifest, name: str) -> dict[str, Any]:
    file = str((manifest.adapters or {})["bundled"][name])
    entry = manifest.files.get(file)
    if entry is None:
        return _row(spec, name, "", 0, bundled=True)
    digest = entry.sha256 if entry.sha256.startswith("sha256:") else f"sha256:{entry.sha256}"
    return _row(spec, name, digest, entry.size, bundled=True)


def _row(spec: FunctionSpec, name: str, digest: str, size: int, *, bundled: bool) -> dict[str, Any]:
    return {"id": f"{spec.name}:{name}", "name": name, "digest": digest, "bytes": size, "bundled": bundled,
            "resident": False}  # fmt: skip


def _file_digest(path: Path) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
