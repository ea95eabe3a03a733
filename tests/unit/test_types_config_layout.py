"""ReduceOp/dtype table, configuration parsing and the arena layout: pure functions."""

from __future__ import annotations

import numpy as np
import pytest

from shmcoll import config, units
from shmcoll.plan import ir
from shmcoll.shm import layout
from shmcoll.types import (
    BFLOAT16,
    DTYPE_CODE,
    DTYPES,
    ReduceOp,
    as_dtype,
    dtype_name,
    dtype_str,
    engine_types,
    identity,
    supports,
    valid_ops,
)


def test_supports_table() -> None:
    assert supports(ReduceOp.SUM, np.float32)
    assert supports(ReduceOp.BXOR, np.uint16)
    assert supports(ReduceOp.BAND, np.bool_)
    assert not supports(ReduceOp.AVG, np.bool_)
    assert not supports(ReduceOp.BAND, np.float64)
    assert not supports(ReduceOp.MIN, np.complex64)
    assert supports(ReduceOp.AVG, np.complex128)
    assert not supports(ReduceOp.SUM, np.dtype("U4"))
    assert not supports(ReduceOp.SUM, np.dtype(">f4"))
    for dt in DTYPES:
        assert valid_ops(dt), dt


def test_engine_types() -> None:
    assert engine_types(np.dtype(np.bool_), ReduceOp.SUM) == (np.dtype(np.uint8), ReduceOp.BOR)
    assert engine_types(np.dtype(np.bool_), ReduceOp.MIN) == (np.dtype(np.uint8), ReduceOp.BAND)
    assert engine_types(np.dtype(np.float16), ReduceOp.AVG) == (np.dtype(np.float32), ReduceOp.AVG)
    assert engine_types(np.dtype(np.int8), ReduceOp.PROD) == (np.dtype(np.int8), ReduceOp.PROD)


def test_bfloat16_in_the_dtype_table() -> None:
    # Codes are in call signatures and point-to-point headers: the old ones never move.
    old = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
    old += ["float16", "float32", "float64", "complex64", "complex128"]
    assert [dt.name for dt in DTYPES[: len(old)]] == old
    assert DTYPES[-1] == BFLOAT16 and DTYPE_CODE[BFLOAT16] == len(old)
    assert len(DTYPES) < 31  # the signature's 5-bit dtype field, 31 meaning "not in the table"
    assert ir.unpack_sig(ir.pack_sig("allreduce", 0, BFLOAT16, 0, 0, 5))["dtype"] == DTYPE_CODE[BFLOAT16]
    assert "bfloat16" in ir.describe_sig(ir.pack_sig("allreduce", 0, BFLOAT16, int(ReduceOp.MAX), 0, 5))
    # A marker, equal to no numeric dtype: float16 and uint16 arrays stay what they are.
    assert BFLOAT16 not in (np.dtype(np.uint16), np.dtype(np.float16), np.dtype("V2"))
    assert not supports(ReduceOp.SUM, np.dtype("V2"))


def test_bfloat16_ops_names_and_identities() -> None:
    assert valid_ops(BFLOAT16) == valid_ops(np.dtype(np.float32))
    assert supports(ReduceOp.AVG, BFLOAT16) and not supports(ReduceOp.BAND, BFLOAT16)
    for op in valid_ops(BFLOAT16):
        assert engine_types(BFLOAT16, op) == (np.dtype(np.float32), op)
    assert dtype_str(BFLOAT16) == dtype_name(DTYPE_CODE[BFLOAT16]) == "bfloat16"
    assert dtype_str(np.dtype(np.float32)) == "float32" and dtype_str(np.dtype(">f4")) == ">f4"
    assert dtype_name(30) == "dtype#30"
    assert as_dtype("bfloat16") == BFLOAT16 and as_dtype("float16") == np.dtype(np.float16)
    bits = {op: int(identity(op, BFLOAT16).view(np.uint16)) for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN)}
    assert bits == {ReduceOp.SUM: 0, ReduceOp.PROD: 0x3F80, ReduceOp.MIN: 0x7F80}  # 0, 1.0, +inf
    out = np.zeros(3, np.uint16).view(BFLOAT16)
    out[...] = identity(ReduceOp.MAX, BFLOAT16)  # how the runtime writes it
    assert out.view(np.uint16).tolist() == [0xFF80] * 3  # -inf


def test_parse_size() -> None:
    assert units.parse_size("64K") == 65536
    assert units.parse_size("1M") == 1 << 20
    assert units.parse_size("2GiB") == 2 << 30
    assert units.parse_size("8") == 8
    assert units.parse_size("8B") == 8
    assert units.parse_size(12) == 12
    assert units.format_size(65536) == "64K"
    assert units.format_size(100) == "100"
    with pytest.raises(ValueError, match="not a size"):
        units.parse_size("lots")


def test_config_from_environment() -> None:
    cfg = config.load(
        {
            "SHMCOLL_TIMEOUT": "2.5",
            "SHMCOLL_SLOT_BYTES": "4K",
            "SHMCOLL_NSLOTS": "8",
            "SHMCOLL_DEBUG": "info",
            "SHMCOLL_RANK": "3",
            "SHMCOLL_SPIN": "auto",
            "SHMCOLL_CACHE_DIR": "/tmp/x",
        }
    )
    assert cfg.timeout_s == 2.5 and cfg.slot_bytes == 4096 and cfg.nslots == 8
    assert cfg.debug == "INFO" and cfg.rank == 3 and cfg.spin is None
    assert cfg.tune_file == "/tmp/x/tune.json"
    assert config.load({}).timeout_s == 60.0
    with pytest.raises(ValueError):
        config.load({"SHMCOLL_TIMEOUT": "0"})
    with pytest.raises(ValueError, match="SHMCOLL_NSLOTS"):
        config.load({"SHMCOLL_NSLOTS": "many"})


def test_layout_lines_never_shared() -> None:
    lay = layout.Layout(world_size=5, nslots=3, slot_bytes=4096)
    assert lay.nchannels == 20
    lines = set()
    for ch in range(lay.nchannels):
        for field in (layout.C_HEAD, layout.C_TAIL):
            line = lay.channel_word(ch, field) // layout.WORDS_PER_LINE
            assert line not in lines
            lines.add(line)
    for r in range(5):
        assert lay.rank_word(r, 0) % layout.WORDS_PER_LINE == 0
    assert lay.rings_base % layout.LINE == 0 and lay.slot_stride % layout.LINE == 0
    # Every payload is aligned for the widest element (complex128).
    assert all((lay.cell_offset(7, c) + layout.SLOT_HEADER_BYTES) % 16 == 0 for c in range(lay.ring_cells))
    # NSLOTS full pieces fit in a ring together whatever a wrap wastes, with the free cell kept
    # beyond the last one (shm/layout's module doc).
    stride_cells = lay.slot_stride // layout.CELL
    assert lay.ring_cells >= (lay.nslots + 1) * stride_cells
    # Checked, from every position the ring can be empty at, with the engine's rules (a message
    # that does not fit before the end starts the next lap; one free cell kept beyond the last).
    for tail in range(lay.ring_cells):
        head = tail
        for _ in range(lay.nslots):
            pos = head % lay.ring_cells
            start = head if stride_cells <= lay.ring_cells - pos else head + lay.ring_cells - pos
            head = start + stride_cells
            assert head + 1 - tail <= lay.ring_cells, (tail, head)


def test_channels_are_a_bijection() -> None:
    lay = layout.Layout(world_size=6, nslots=1, slot_bytes=64)
    seen = {lay.channel(s, d) for s in range(6) for d in range(6) if s != d}
    assert seen == set(range(lay.nchannels))
    with pytest.raises(ValueError):
        lay.channel(2, 2)


def test_footprint_formula() -> None:
    n, nslots, slot = 8, 4, 64 << 10
    stride = layout.round_up(32 + slot, 64)
    mail = min(nslots, 2)
    rings = n * (n - 1) * (nslots + 1) * stride
    expected = 192 + 256 * n + 192 * n * (n - 1) + 128 * n * n + rings + n * n * mail * stride
    assert layout.footprint_bytes(n, nslots, slot) == expected
    assert layout.footprint_bytes(1, 4, slot) == 192 + 256 + 128 + 2 * layout.round_up(32 + slot, 64)


def test_a_compile_tells_its_listeners(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """jit.on_compile hears True when one of shmcoll's kernels starts compiling, False when done
    (the communicator turns it into its rank record's R_COMPILING)."""
    import numpy as np

    from shmcoll import jit

    heard: list[bool] = []
    jit.on_compile(heard.append)
    try:

        @jit.jit(cache=False)
        def fresh(a):  # type: ignore[no-untyped-def]
            return a.sum() + 1

        assert fresh(np.arange(3)) == 4
        assert heard == [True, False]
        fresh(np.arange(4))  # compiled already: nothing to say
        assert heard == [True, False]
    finally:
        jit._COMPILE_LISTENERS.remove(heard.append)


def _jit_dependencies(path: str, package_root: str) -> set[str]:
    """The files (relative to ``shmcoll/``) whose names the functions decorated with shmcoll's
    ``@jit`` in ``path`` use: the file itself if it has one, and each shmcoll module a name they
    use was imported from (``from shmcoll.shm import layout`` or ``from shmcoll.shm.layout
    import X``). Read from the source, importing nothing."""
    import ast
    import os

    with open(path) as f:
        tree = ast.parse(f.read())
    origin: dict[str, str] = {}  # name bound at module level -> the file it came from
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shmcoll":
            base = node.module.split(".")[1:]
            for alias in node.names:
                # a module of its own (``from shmcoll.shm import layout``), else a name in the module
                # imported from, a file or a package
                for parts in ((*base, alias.name), tuple(base)):
                    if parts and os.path.exists(os.path.join(package_root, *parts) + ".py"):
                        rel = "/".join(parts) + ".py"
                        break
                else:
                    rel = "/".join((*base, "__init__.py"))
                origin[alias.asname or alias.name] = rel

    def decorated(fn: ast.AST) -> bool:
        for d in getattr(fn, "decorator_list", ()):
            target = d.func if isinstance(d, ast.Call) else d
            if isinstance(target, ast.Name) and target.id == "jit" and origin.get("jit") == "jit.py":
                return True
        return False

    found: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and decorated(fn):
            found.add(os.path.relpath(path, package_root).replace(os.sep, "/"))
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and node.id in origin and node.id != "jit":
                    found.add(origin[node.id])
    return found


def test_the_cache_key_covers_every_jitted_source() -> None:
    """Numba's cache checks a function's own file only, so ``jit.SOURCE_KEY`` hashes every file
    whose code or constants end up in shmcoll's jitted functions: an edited helper in another
    file must give a fresh cache directory. (``engine/mailbox.py`` was missing, so an edit to the
    mailbox's kernels did not change the key.)"""
    import os

    from shmcoll import jit

    root = os.path.dirname(jit.__file__)
    needed: set[str] = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                needed |= _jit_dependencies(os.path.join(dirpath, f), root)
    assert "engine/cpu.py" in needed and "shm/atomics.py" in needed  # the scan sees the engine
    missing = sorted(needed - set(jit._JITTED_SOURCES))
    assert not missing, f"jitted code uses these files, which jit._JITTED_SOURCES does not hash: {missing}"
