"""Training on shmcoll: the data loaders, the MLP's backward pass, and ``shmcoll train mnist``."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from shmcoll.train import data as D
from shmcoll.train import mnist as T
from shmcoll.train.mlp import MLP, SGD

DEADLINE_S = 150  # per command; each also passes --timeout to its ranks


def _shmcoll(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmcoll.cli", *args], capture_output=True, text=True, timeout=DEADLINE_S
    )


# --- data ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-5, 0, 7], dtype=np.int32),
        np.linspace(-1, 1, 6).reshape(3, 2),
        np.array([1.5, -2.25], dtype=np.float32),
        np.array([-3, 3], dtype=np.int16),
        np.array([-1, 1], dtype=np.int8),
    ],
)
def test_idx_round_trip(tmp_path, array: np.ndarray, suffix: str) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / f"a.idx{suffix}")
    D.write_idx(path, array)
    back = D.read_idx(path)
    assert back.dtype.newbyteorder("=") == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_idx_layout_is_big_endian_with_the_mnist_header(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "labels")
    D.write_idx(path, np.array([258], dtype=np.int32))
    with open(path, "rb") as f:
        raw = f.read()
    assert raw == bytes([0, 0, 0x0C, 1, 0, 0, 0, 1, 0, 0, 1, 2])
    images = bytes([0, 0, 0x08, 3]) + (2).to_bytes(4, "big") + (2).to_bytes(4, "big") + (1).to_bytes(4, "big")
    with gzip.open(tmp_path / "named-anything", "wb") as f:  # gzip recognised by content, not name
        f.write(images + bytes([1, 2, 3, 4]))
    np.testing.assert_array_equal(D.read_idx(str(tmp_path / "named-anything")), [[[1], [2]], [[3], [4]]])


def test_idx_rejects_malformed_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad"
    for content, message in [
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "magic"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "type code"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x01", "truncated"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x05", "says"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            D.read_idx(str(bad))
    with pytest.raises(TypeError):
        D.write_idx(str(bad), np.array([1], dtype=np.uint16))


def _write_mnist_dir(root, n_train: int, n_test: int, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    for split, n, gz in (("train", n_train, ".gz"), ("t10k", n_test, "")):
        D.write_idx(str(root / f"{split}-images-idx3-ubyte{gz}"), rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        D.write_idx(str(root / f"{split}-labels-idx1-ubyte{gz}"), rng.integers(0, 10, n, dtype=np.uint8))


def test_load_idx_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _write_mnist_dir(tmp_path, 12, 5)
    ds = D.load_idx_dir(str(tmp_path))
    assert ds.train_images.shape == (12, 28, 28) and ds.test_images.shape == (5, 28, 28)
    assert ds.train_labels.shape == (12,) and ds.test_labels.dtype == np.uint8
    np.testing.assert_array_equal(ds.train_labels, D.read_idx(str(tmp_path / "train-labels-idx1-ubyte.gz")))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        D.load_idx_dir(str(tmp_path))
    D.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte"), np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="5 t10k images"):
        D.load_idx_dir(str(tmp_path))


def test_bundled_subset_split() -> None:
    ds = D.load_bundled()
    assert ds.train_images.shape == (4000, 28, 28) and ds.test_images.shape == (1000, 28, 28)
    assert ds.train_images.dtype == np.uint8 and ds.train_images.max() > 200
    assert np.bincount(ds.test_labels, minlength=10).min() >= 70  # shuffled: every class held out
    again = D.load_bundled()
    np.testing.assert_array_equal(ds.test_labels, again.test_labels)
    whole = np.load(D.BUNDLED_PATH)
    assert sorted(np.bincount(whole["labels"])) == [500] * 10
    x = D.as_features(ds.test_images[:3])
    assert x.shape == (3, 784) and x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1


# --- the model ----------------------------------------------------------------------------------
def test_backward_matches_finite_differences() -> None:
    rng = np.random.default_rng(3)
    model = MLP((6, 5, 4, 3), seed=1)
    model.params += rng.standard_normal(model.num_params).astype(np.float32) * 0.1  # nonzero biases too
    x = rng.standard_normal((7, 6)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    model.loss_and_grad(x, y, scale=1.0)
    analytic = model.grads.astype(np.float64).copy()
    eps = 1e-3  # small enough that no pre-activation here crosses zero (a relu kink) within +-eps
    for i in range(model.num_params):
        saved = model.params[i]
        model.params[i] = saved + eps
        up, _ = model.evaluate(x, y)
        model.params[i] = saved - eps
        down, _ = model.evaluate(x, y)
        model.params[i] = saved
        numeric = (up - down) / (2 * eps)
        assert abs(numeric - analytic[i]) <= 2e-3 + 2e-2 * abs(numeric), (i, numeric, analytic[i])


def test_grad_scale_and_loss_sum() -> None:
    model = MLP((4, 3, 2), seed=0)
    x = np.ones((5, 4), np.float32)
    y = np.array([0, 1, 0, 1, 1])
    loss, correct = model.loss_and_grad(x, y, scale=1.0)
    g1 = model.grads.copy()
    loss2, _ = model.loss_and_grad(x, y, scale=0.25)
    assert loss == pytest.approx(loss2) and loss == pytest.approx(5 * np.log(2), rel=0.5)
    np.testing.assert_allclose(model.grads, 0.25 * g1, rtol=1e-6, atol=1e-9)
    assert correct in (2, 3)  # identical rows: all predicted the same class
    with pytest.raises(ValueError):
        MLP((4,))
    with pytest.raises(ValueError):
        MLP((4, 2), grad_buffer=np.zeros(3, np.float32))


def test_sgd_momentum_matches_formula() -> None:
    p = np.array([1.0, -2.0, 0.5], np.float32)
    g = np.array([0.1, 0.2, -0.3], np.float32)
    opt = SGD(p, g, lr=0.5, momentum=0.9)
    opt.step()
    opt.step()
    v = 0.9 * g + g
    np.testing.assert_allclose(p, np.array([1.0, -2.0, 0.5]) - 0.5 * g - 0.5 * v, rtol=1e-6)
    with pytest.raises(ValueError):
        SGD(p, g, lr=0.1, momentum=1.0)


def test_shards_cover_the_batch() -> None:
    for lo, hi, world in ((0, 128, 4), (3, 10, 3), (0, 5, 8)):
        parts = [T._shard(lo, hi, r, world) for r in range(world)]
        assert parts[0][0] == lo and parts[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
        assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_config_validation() -> None:
    T.TrainConfig().validate()
    for bad in (
        {"batch_size": 2, "nprocs": 4},
        {"lr": 0},
        {"momentum": 1.0},
        {"hidden": ()},
        {"bucket_mb": 0},
        {"algorithm": "telepathy"},
        {"data_dir": "/nonexistent/mnist"},
        {"slot_bytes": 100},
    ):
        with pytest.raises(ValueError):
            T.TrainConfig(**bad).validate()  # type: ignore[arg-type]


def _result(losses: list[float], params: list[float]) -> T.TrainResult:
    steps = len(losses)
    return T.TrainResult(
        config=T.TrainConfig(),
        dataset="synthetic",
        num_params=len(params),
        buckets=1,
        losses=np.array(losses),
        epochs=[T.EpochStats(1, 0.5, 0.9, 0.5, 0.9, 1.0)],
        compute_s=[np.full(steps, 1e-3)],
        comm_s=[np.full(steps, 2e-3)],
        digest_checks=1,
        params=np.array(params, np.float32),
        wall_s=1.0,
    )


def test_compare_flags_loss_curves_beyond_the_tolerance() -> None:
    reference = _result([2.0, 1.0, 0.5], [0.0, 1.0])
    close = T.compare(_result([2.0, 1.00001, 0.5], [0.0, 1.5]), reference, tolerance=1e-4)
    assert close.ok and close.max_loss_diff == pytest.approx(1e-5) and close.max_param_diff == 0.5
    far = T.compare(_result([2.0, 1.0, 0.6], [0.0, 1.0]), reference, tolerance=1e-4)
    assert not far.ok and far.max_loss_diff == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different numbers of steps"):
        T.compare(_result([2.0], [0.0, 1.0]), reference, tolerance=1e-4)
    times = reference.step_times()  # the first step is left out
    assert times["compute"] == pytest.approx(1e-3) and times["total"] == pytest.approx(3e-3)
    assert "held-out accuracy 0.9000" in T.format_summary(reference)


def test_cli_usage_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shmcoll.cli.main import main  # here: shmcoll.cli is a package only once installed (package-dir)

    runner = CliRunner()
    assert "mnist" in runner.invoke(main, ["train", "--help"]).output
    result = runner.invoke(main, ["train", "mnist", "-n", "1", "--check-equivalence"])
    assert result.exit_code == 2 and "--nprocs 2" in result.output
    result = runner.invoke(main, ["train", "mnist", "--hidden", "256,x"])
    assert result.exit_code == 2 and "layer widths" in result.output
    result = runner.invoke(main, ["train", "mnist", "--algorithm", "telepathy"])
    assert result.exit_code == 2 and "telepathy" in result.output
    result = runner.invoke(main, ["train", "mnist", "--slot-bytes", "lots"])
    assert result.exit_code == 2 and "not a size" in result.output
    result = runner.invoke(main, ["train", "mnist", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "train-images-idx3-ubyte" in result.output


# --- end to end, on processes -------------------------------------------------------------------
def test_train_mnist_equivalence_accuracy_buckets_and_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    proc = _shmcoll(
        "train", "mnist", "-n", "2", "--epochs", "2", "--bucket-mb", "0.25", "--check-every", "20",
        "--check-equivalence", "--target-acc", "0.85", "--plot", str(png), "--quiet", "--timeout", "120",
        "--slot-bytes", "256K",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    eq = re.search(r"max \|loss difference\| over (\d+) steps (\S+) \(tolerance (\S+)\): OK", out)
    assert eq, out
    assert int(eq.group(1)) == 64 and float(eq.group(2)) <= float(eq.group(3)) == 1e-4
    accs = [float(a) for a in re.findall(r"held-out accuracy (\S+) after 2 epoch", out)]
    assert len(accs) == 2 and min(accs) >= 0.85 and accs[0] == accs[1]  # same global batch: same model
    assert "4 allreduce(op=AVG" in out  # 0.9 MiB of gradients in 0.25 MiB buckets
    assert re.search(r"replicas bitwise identical \(4 digest check", out)  # steps 20, 40, 60 and the end
    assert "compute" in out and "communication" in out
    assert png.stat().st_size > 10_000


def test_train_mnist_fails_loudly_when_replicas_diverge() -> None:
    proc = _shmcoll(
        "train", "mnist", "-n", "2", "--epochs", "1", "--steps-per-epoch", "12", "--check-every", "5",
        "--inject-divergence", "2", "--quiet", "--timeout", "60",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "ReplicaDivergenceError" in proc.stderr and "after step 5" in proc.stderr
    assert "differ from rank 0" in proc.stderr


def test_train_mnist_data_dir_and_target_accuracy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _write_mnist_dir(tmp_path, 96, 40)  # random pixels and labels: nothing to learn
    proc = _shmcoll(
        "train", "mnist", "-n", "2", "--data-dir", str(tmp_path), "--epochs", "2", "--batch-size", "32",
        "--hidden", "16", "--target-acc", "0.99", "--timeout", "60",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"MNIST from {tmp_path}: 96 training images, 40 held out" in proc.stdout
    assert "MLP 784-16-10" in proc.stdout and "epoch 2/2" in proc.stdout
    assert "is below the target 0.99" in proc.stderr
