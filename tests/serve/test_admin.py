"""The admin service: off by default, token-guarded, confined to the delta root, and every
malformed delta a deliberate status (never INTERNAL). Over real gRPC on 127.0.0.1 and a Unix
socket, with small synthetic bundles (tests/serve/conftest.py) and deltas made from them."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import load_file, save_file

from protos import predict_pb2, predict_pb2_grpc
from serve.admin import ADMIN_SERVICE_NAME, AdminConfig, AdminServer
from serve.delta import no_delta_at
from serve.metrics import ServingMetrics
from serve.model import LoadedModel
from serve.security import BearerTokenInterceptor, bind, read_token
from serve.server import PredictionServer, ServerConfig
from serve.versions import ModelManager
from shared.bundle import read_bundle
from shared.bundle.layout import sha256
from shared.delta import diff_tables, write_delta
from shared.dense_inputs import INPUT_NAMES, dense_layout
from shared.features import FeatureSet
from train.tools.__main__ import main

from .conftest import TinyDense

TOKEN = "test-token-0123456789abcdef"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
SUMMARY = {
    "score_strategy": "LFU",
    "score_histogram": [{"lower": 1, "upper": 2, "count": 3}],
    "top_keys": [{"key": 5, "score": 9}],
    "admission": {"threshold": 3, "pending": 2, "pending_by_count": {"1": 2}},
}


# --------------------------------------------------------------------------- fixtures


def make_delta(base: Path, out: Path, delta_id: str, program: Path | None = None) -> Path:
    """A delta of ``base``: two dense rows moved, one key of each dynamic table evicted, one
    new and the others updated; ``program`` as its dense program."""
    b = read_bundle(base)
    dense = {n: w.clone() for n, w in b.dense_tables.items()}
    for w in dense.values():
        w[:2] += 0.5
    hashed = {
        n: (torch.cat([k[1:], torch.tensor([10**9])]), torch.cat([v[1:] + 0.25, v[:1]]))
        for n, (k, v) in b.hash_tables.items()
    }
    tables = diff_tables(b.dense_tables, b.hash_tables, dense, hashed)
    summaries = {n: SUMMARY for n in b.hash_tables}
    return write_delta(
        out,
        tables=tables,
        base_manifest=b.manifest,
        delta_id=delta_id,
        target_version=delta_id,
        config_digest=b.config_digest,
        dense_program_path=program,
        table_summaries=summaries,
    )


def misfit_program(fs: FeatureSet, path: Path) -> Path:
    """A dense program that loads but does not run with the tables: exported for fixed batch
    sizes and one more user input column than they give."""
    lay = dense_layout(fs)
    module = TinyDense(lay.user_deep_dim + 1, lay.item_deep_dim, lay.seq_dim).eval()
    example = {
        "user_deep": torch.randn(2, lay.user_deep_dim + 1),
        "item_deep": torch.randn(3, lay.item_deep_dim),
        "query": torch.randn(3, lay.seq_dim),
        "seq_values": torch.randn(4, lay.seq_dim),
        "seq_lengths": torch.tensor([3, 1]),
        "user_index": torch.tensor([0, 1, 1]),
    }
    kwargs = {n: example[n] for n in INPUT_NAMES}
    torch.export.save(torch.export.export(module, (), kwargs=kwargs, strict=False), path)
    return path


class Env:
    def __init__(self, root: Path, bundle: Path, manager: ModelManager, metrics: ServingMetrics):
        self.root = root  # the delta root
        self.bundle = bundle
        self.manager = manager
        self.metrics = metrics
        self.good = make_delta(bundle, root / "good", "d1")
        self.token_file = root.parent / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)

    def copy(self, name: str) -> Path:
        """A copy of the good delta under the root, to damage."""
        return Path(shutil.copytree(self.good, self.root / name))


@pytest.fixture(scope="module")
def env(bundle_v1: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("admin") / "deltas"
    root.mkdir()
    manager = ModelManager(
        lambda p: LoadedModel.load(p, device="cpu", warmup_rounds=1, warmup_candidates=8)
    )
    assert manager.load(bundle_v1)
    metrics = ServingMetrics(lambda: manager.current)
    yield Env(root, bundle_v1, manager, metrics)
    manager.stop()
    metrics.close()


@pytest.fixture
def start(env: Env) -> Iterator[Callable[..., AdminServer]]:
    """Start an AdminServer (default: over the module's model, with the delta root, health
    SERVING); stopped after the test."""
    servers: list[AdminServer] = []

    def run(
        tls: Any = None, manager: ModelManager | None = None, serving: bool = True, **kw: Any
    ) -> AdminServer:
        config = AdminConfig(**{"delta_root": env.root, **kw})
        srv = AdminServer(
            config,
            manager or env.manager,
            env.metrics,
            tls=tls,
            verify_checksums=True,
            warmup_candidates=8,
        )
        servers.append(srv.start())
        srv.set_serving(serving)
        return srv

    yield run
    for srv in servers:
        srv.stop(grace=0)


@pytest.fixture
def admin(start: Callable[..., AdminServer]) -> Iterator[predict_pb2_grpc.ModelAdminServiceStub]:
    """A stub of an admin service on loopback without a token, with the delta root."""
    srv = start()
    with grpc.insecure_channel(srv.target) as channel:
        yield predict_pb2_grpc.ModelAdminServiceStub(channel)


def _apply(stub: predict_pb2_grpc.ModelAdminServiceStub, path: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path=path), timeout=60)
    return info.value


# --------------------------------------------------------------------------- off by default


def test_public_port_has_no_admin_service_unless_configured(bundle_v1: Path) -> None:
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cpu")).start()
    try:
        assert srv.wait_ready(60), srv.load_error
        assert srv.admin is None
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.InspectTables(predict_pb2.InspectRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.RpcError) as info:
                stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="x"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert ADMIN_SERVICE_NAME not in _listed(channel)
    finally:
        srv.stop(grace=0)


def test_server_config_starts_the_admin_service_on_its_own_port(bundle_v1: Path, env: Env) -> None:
    admin = AdminConfig(address="127.0.0.1:0", delta_root=env.root)
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cpu", admin=admin)).start()
    try:
        assert srv.wait_ready(60), srv.load_error
        assert srv.admin_port not in (None, 0, srv.port)
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
            assert stub.InspectTables(predict_pb2.InspectRequest(), timeout=10).model_version
            assert _health(channel, ADMIN_SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=0)


def test_admin_config_refuses_an_open_address_without_a_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--admin-token-file"):
        AdminConfig(address="0.0.0.0:8501")
    AdminConfig(address="0.0.0.0:8501", token_file=tmp_path / "token")  # checked at start()
    for local in ("127.0.0.1:0", "localhost:8501", "[::1]:8501", f"unix:{tmp_path}/a.sock"):
        AdminConfig(address=local)
    with pytest.raises(ValueError, match="abstract"):
        AdminConfig(address="unix-abstract:admin")
    with pytest.raises(ValueError, match="HOST:PORT"):
        AdminConfig(address="127.0.0.1")


# --------------------------------------------------------------------------- health, reflection


def _health(channel: grpc.Channel, service: str) -> int:
    req = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(req, timeout=10).status


def _listed(channel: grpc.Channel, metadata: Any = ()) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    resp = next(iter(stub.ServerReflectionInfo(iter([req]), metadata=metadata, timeout=10)))
    return {s.name for s in resp.list_services_response.service}


def test_health_not_serving_until_set_and_reflection(start: Callable[..., AdminServer]) -> None:
    srv = start(serving=False)
    with grpc.insecure_channel(srv.target) as channel:
        for name in ("", ADMIN_SERVICE_NAME):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        srv.set_serving(True)
        for name in ("", ADMIN_SERVICE_NAME):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.SERVING
        assert {ADMIN_SERVICE_NAME, "grpc.health.v1.Health"} <= _listed(channel)
        assert "dynrec.serving.PredictionService" not in _listed(channel)


# --------------------------------------------------------------------------- token


def test_token_required_when_configured(env: Env, start: Callable[..., AdminServer]) -> None:
    srv = start(token_file=env.token_file)
    request = predict_pb2.InspectRequest()
    with grpc.insecure_channel(srv.target) as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        for metadata in (
            (),
            (("authorization", "Bearer wrong-token-0123456789abcdef"),),
            (("authorization", TOKEN),),  # no scheme
            (("authorization", f"Basic {TOKEN}"),),
            (("x-token", TOKEN),),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.InspectTables(request, metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "Bearer <token>" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="good"), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                _listed(channel, metadata)  # reflection too
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for scheme in ("Bearer", "bearer"):
            ok = stub.InspectTables(
                request, metadata=(("authorization", f"{scheme} {TOKEN}"),), timeout=10
            )
            assert ok.tables
        assert ADMIN_SERVICE_NAME in _listed(channel, (("authorization", f"Bearer {TOKEN}"),))
        assert _health(channel, "") == health_pb2.HealthCheckResponse.SERVING  # no token needed
    labels = {"method": "InspectTables", "code": "UNAUTHENTICATED"}
    assert env.metrics.registry.get_sample_value("dynrec_serving_errors_total", labels) >= 5


def test_read_token_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    with pytest.raises(ValueError, match=f"{path}: cannot read it"):
        read_token(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match=f"{path}: empty"):
        read_token(path)
    path.write_text("short\n")
    with pytest.raises(ValueError, match=f"{path}: 5 characters, at least 16"):
        read_token(path)
    path.write_text("two tokens-0123456789 here\n")
    with pytest.raises(ValueError, match="without spaces"):
        read_token(path)
    path.write_text(f"  {TOKEN}\n")
    assert read_token(path) == TOKEN
    with pytest.raises(ValueError, match="empty token"):
        BearerTokenInterceptor("")


def test_unix_socket_and_cli_with_token(
    env: Env, start: Callable[..., AdminServer], capsys
) -> None:
    sock = env.root.parent / "admin.sock"
    srv = start(address=f"unix:{sock}", token_file=env.token_file)
    assert srv.port == 0 and srv.target == f"unix:{sock}"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    server = ["--server", srv.target]
    assert main(["inspect", *server, "--json"]) == 2  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["inspect", *server, "--token-file", str(env.token_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["where"] == srv.target and report["tables"]
    assert main(["inspect", "--checkpoint", "x", "--token-file", str(env.token_file)]) == 2
    assert "for --server" in capsys.readouterr().err
    args = ["delta-apply", *server, "--token-file", str(env.token_file), "--delta", "good"]
    assert main([*args, "--json"]) == 0
    applied = json.loads(capsys.readouterr().out)
    assert applied["model_version"] == "1+d1" and applied["deltas"][-1] == "d1"


def test_bind_errors_name_the_address(env: Env, start: Callable[..., AdminServer]) -> None:
    taken = start()
    with pytest.raises(OSError, match=f"cannot bind {taken.target}"):
        start(address=taken.target)
    missing = f"unix:{env.root.parent}/no/such/dir/admin.sock"
    with pytest.raises(OSError, match=f"cannot bind {missing}"):
        bind(grpc.server(futures.ThreadPoolExecutor(1)), missing, None)


# --------------------------------------------------------------------------- delta root


def test_writes_off_or_no_root_refused(start: Callable[..., AdminServer], env: Env) -> None:
    for kw, text in (
        ({"allow_writes": False}, "--no-admin-writes"),
        ({"delta_root": None}, "--delta-root"),
    ):
        srv = start(**kw)
        with grpc.insecure_channel(srv.target) as channel:
            stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
            err = _apply(stub, "good")
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED and text in err.details()
            err = _apply(stub, "/etc")  # refused before the path is looked at
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert stub.InspectTables(predict_pb2.InspectRequest(), timeout=10).tables


def test_no_model_yet_is_unavailable(start: Callable[..., AdminServer]) -> None:
    srv = start(manager=ModelManager(lambda p: LoadedModel.load(p, device="cpu")), serving=False)
    with grpc.insecure_channel(srv.target) as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        assert _apply(stub, "good").code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            stub.InspectTables(predict_pb2.InspectRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_paths_outside_the_root_or_not_deltas_get_one_refusal(
    env: Env, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    outside = make_delta(env.bundle, env.root.parent / "outside", "d9")  # a real delta
    (env.root / "link-out").symlink_to(outside)
    (env.root / "not-a-delta").mkdir(exist_ok=True)
    (env.root / "a-file").write_text("x")
    manifest_link = env.root / "manifest-link"
    manifest_link.mkdir(exist_ok=True)
    (manifest_link / "manifest.json").symlink_to(outside / "manifest.json")
    paths = [
        "../outside",
        "good/../../outside",
        str(outside),  # absolute, a delta
        str(env.good),  # absolute, the good delta under the root
        "/nonexistent",
        "link-out",
        "missing",
        "not-a-delta",
        "a-file",
        "good/manifest.json",
        "manifest-link",
        "good/\0",
    ]
    texts = set()
    for path in paths:
        err = _apply(admin, path)
        assert err.code() == INVALID, path
        assert err.details() == no_delta_at(path), path
        assert str(env.root) not in err.details().replace(repr(path), "")
        texts.add(err.details().replace(repr(path), "<path>"))
    assert len(texts) == 1, texts
    assert "no readable delta at <path> under the delta root" in texts.pop()
    assert _apply(admin, "").code() == INVALID


def test_manifest_files_outside_the_delta_are_refused(
    env: Env, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    texts = set()
    for i, name in enumerate(("/etc/passwd", "/nonexistent", "../good/delta.safetensors", "x/..")):
        d = env.copy(f"files-{i}")
        m = json.loads((d / "manifest.json").read_text())
        m["files"][name] = {"size": 1, "sha256": "0" * 64}
        (d / "manifest.json").write_text(json.dumps(m))
        err = _apply(admin, d.name)
        assert err.code() == INVALID, name
        assert "is not a file of a delta" in err.details() and "never read" in err.details()
        texts.add(err.details().replace(json.dumps(name), "<name>").replace(d.name, "<d>"))
    assert len(texts) == 1, texts  # an existing file and a missing one read alike


# --------------------------------------------------------------------------- malformed deltas


def _manifest(d: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _refile(d: Path, name: str) -> None:
    """Make the manifest's size and checksum of ``name`` fit the file again."""
    p = d / name

    def edit(m: dict[str, Any]) -> None:
        m["files"][name] = {"size": p.stat().st_size, "sha256": sha256(p)}

    _manifest(d, edit)


def _tensors(edit: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[Path], None]:
    def run(d: Path) -> None:
        tensors = load_file(d / "delta.safetensors")
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "delta.safetensors")
        _refile(d, "delta.safetensors")

    return run


def _table(m: dict[str, Any], hashmap: bool) -> str:
    return next(n for n, c in m["tables"].items() if c["is_hashmap"] is hashmap)


def _hash_name(d: Path) -> str:
    return _table(json.loads((d / "manifest.json").read_text()), True)


def _dense_name(d: Path) -> str:
    return _table(json.loads((d / "manifest.json").read_text()), False)


def _set(d: Path, where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> None:
    _manifest(d, lambda m: where(m).__setitem__(key, value))


def _tensor_edit(d: Path, fn: Callable[[dict[str, torch.Tensor], str, str], Any]) -> None:
    h, dn = _hash_name(d), _dense_name(d)
    _tensors(lambda t: fn(t, h, dn))(d)


def _truncate(d: Path, refile: bool) -> None:
    p = d / "delta.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    if refile:
        _refile(d, "delta.safetensors")


def _flip(d: Path) -> None:
    p = d / "delta.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def _program(d: Path, data: bytes | Path) -> None:
    p = d / "dense.pt2"
    if isinstance(data, Path):
        shutil.copyfile(data, p)
    else:
        p.write_bytes(data)
    _set(d, lambda m: m, "dense_program", True)
    _refile(d, "dense.pt2")


def _symlinked_tensors(d: Path) -> None:
    outside = d.parent.parent / f"{d.name}.safetensors"
    shutil.move(d / "delta.safetensors", outside)
    (d / "delta.safetensors").symlink_to(outside)


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "bad JSON": (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
    "a JSON list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), "not a JSON object"),
    "deep JSON": (lambda d: (d / "manifest.json").write_text("[" * 100000), "not valid JSON"),
    "format version true": (
        lambda d: _set(d, lambda m: m, "format_version", True),
        "format",
    ),
    "tables missing": (lambda d: _manifest(d, lambda m: m.pop("tables")), "'tables' is missing"),
    "tables a list": (lambda d: _set(d, lambda m: m, "tables", []), "expected an object"),
    "dimension a string": (
        lambda d: _set(d, lambda m: m["tables"][_table(m, True)], "dimension", "16"),
        "'dimension' is \"16\", expected an integer",
    ),
    "is_hashmap a string": (
        lambda d: _set(d, lambda m: m["tables"][_table(m, True)], "is_hashmap", "yes"),
        "'is_hashmap' is \"yes\", expected true or false",
    ),
    "negative target rows": (
        lambda d: _set(d, lambda m: m["tables"][_table(m, False)], "target_rows", -1),
        "'target_rows' is -1",
    ),
    "new above upserts": (
        lambda d: _set(d, lambda m: m["tables"][_table(m, True)], "new", 10**6),
        "'new' is 1000000",
    ),
    "file size a string": (
        lambda d: _set(d, lambda m: m["files"]["delta.safetensors"], "size", "12"),
        "'size' is \"12\"",
    ),
    "delta id with a slash": (lambda d: _set(d, lambda m: m, "delta_id", "a/b"), "delta_id"),
    "digest not hex": (
        lambda d: _set(d, lambda m: m["base"], "manifest_digest", "xyz"),
        "not a sha256 hex digest",
    ),
    "summary key a string": (
        lambda d: _set(d, lambda m: m, "table_summaries", {"t": {"top_keys": [{"key": "a"}]}}),
        "table_summaries['t'].top_keys[0]: 'key' is \"a\"",
    ),
    "summary admission a list": (
        lambda d: _set(d, lambda m: m, "table_summaries", {"t": {"admission": [1]}}),
        "'admission' is [1], expected an object",
    ),
    "dense program not listed": (
        lambda d: _set(d, lambda m: m, "dense_program", True),
        "expected ['delta.safetensors', 'dense.pt2']",
    ),
    "tensor missing": (
        lambda d: _tensor_edit(d, lambda t, h, _: t.pop(f"{h}.evict_keys")),
        ".evict_keys' is missing",
    ),
    "extra tensor": (
        lambda d: _tensor_edit(d, lambda t, *_: t.__setitem__("zzz.rows", torch.zeros(1))),
        "['zzz.rows'] belong to no table",
    ),
    "values of another dim": (
        lambda d: _tensor_edit(
            d, lambda t, h, _: t.__setitem__(f"{h}.upsert_values", t[f"{h}.upsert_values"][:, 1:])
        ),
        "expected torch.float32 [",
    ),
    "int32 keys": (
        lambda d: _tensor_edit(
            d, lambda t, h, _: t.__setitem__(f"{h}.upsert_keys", t[f"{h}.upsert_keys"].int())
        ),
        "is torch.int32",
    ),
    "repeated keys": (
        lambda d: _tensor_edit(d, lambda t, h, _: t[f"{h}.upsert_keys"].fill_(7)),
        "repeats keys",
    ),
    "NaN values": (
        lambda d: _tensor_edit(d, lambda t, h, _: t[f"{h}.upsert_values"].fill_(float("nan"))),
        "NaN or infinite",
    ),
    "dense row out of range": (
        lambda d: _tensor_edit(d, lambda t, _, n: t[f"{n}.rows"].fill_(10**9)),
        "rows outside",
    ),
    "negative dense row": (
        lambda d: _tensor_edit(d, lambda t, _, n: t[f"{n}.rows"].fill_(-1)),
        "rows outside",
    ),
    "truncated safetensors": (lambda d: _truncate(d, refile=True), "not a readable safetensors"),
    "truncated, manifest not updated": (
        lambda d: _truncate(d, refile=False),
        "bytes, the manifest says",
    ),
    "checksum mismatch": (_flip, "sha256 mismatch"),
    "symlinked tensors": (_symlinked_tensors, "not a regular file of the delta directory"),
    "dense.pt2 not a program": (
        lambda d: _program(d, b"PK not a zip"),
        "dense.pt2: not a loadable dense program",
    ),
    "target rows of another base": (
        lambda d: _manifest(
            d, lambda m: m["tables"][_table(m, True)].__setitem__("target_rows", 1)
        ),
        "made for another base bundle",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_deltas_are_invalid_argument(
    case: str, env: Env, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    damage, expected = MALFORMED[case]
    d = env.copy(f"bad-{case.replace(' ', '-').replace(',', '')}")
    damage(d)
    before = env.manager.current
    err = _apply(admin, d.name)
    assert err.code() == INVALID, err.details()
    assert expected in err.details(), err.details()
    assert err.details().startswith(f"delta {d.name!r}: ")  # named by the request, not the path
    assert str(env.root) not in err.details()
    assert env.manager.current is before  # the old model keeps serving


def test_a_program_that_does_not_fit_the_tables(
    env: Env, fs: FeatureSet, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    d = env.copy("misfit-program")
    _program(d, misfit_program(fs, env.root.parent / "misfit.pt2"))
    err = _apply(admin, d.name)
    assert err.code() == INVALID, err.details()
    assert "dense.pt2 does not run with the tables" in err.details()


def test_a_delta_for_another_base_is_failed_precondition(
    env: Env, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    d = env.copy("foreign")
    _set(d, lambda m: m["base"], "manifest_digest", "0" * 64)
    err = _apply(admin, d.name)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "made for base bundle '1'" in err.details()
    assert str(env.bundle) not in err.details()


def test_good_deltas_apply_and_inspect(
    env: Env, bundle_v2: Path, admin: predict_pb2_grpc.ModelAdminServiceStub
) -> None:
    resp = admin.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="good"), timeout=60)
    assert resp.model_version == "1+d1" and resp.deltas[-1] == "d1"
    assert not resp.dense_program
    counts = [t for t in resp.tables.values() if t.is_hashmap]
    assert counts and all(t.new == 1 and t.evicted == 1 for t in counts)
    report = admin.InspectTables(predict_pb2.InspectRequest(top_k=1), timeout=10)
    assert report.model_version == "1+d1"
    hashed = [t for t in report.tables if t.is_hashmap]
    assert hashed and all(t.top_keys[0].key == 5 and t.admission_pending == 2 for t in hashed)
    # a delta with its own dense program (bundle v2's: same signature, other weights)
    program = read_bundle(bundle_v2).dense_program_path
    make_delta(env.bundle, env.root / "with-program", "d2", program=program)
    resp = admin.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="with-program/"), timeout=60)
    assert resp.model_version == "1+d2" and resp.dense_program
    assert list(resp.deltas[-2:]) == ["d1", "d2"]
