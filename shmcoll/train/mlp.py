"""A small multilayer perceptron in numpy with a hand-written backward pass, and SGD with momentum.

The parameters live in one flat float32 array and the gradients in another; every weight matrix
and bias vector is a view into them. That layout is what makes data parallelism cheap here: the
gradient buffer *is* the allreduce bucket (no packing or unpacking), and comparing replicas is
hashing one array.

Layer ``l`` computes ``h_{l+1} = relu(h_l @ W_l + b_l)`` (no relu on the last layer, whose output
are the logits of a softmax cross-entropy loss). ``W_l`` has shape ``(fan_in, fan_out)``.

The fused elementwise kernels (bias + relu, relu backward, softmax cross-entropy, the momentum
update) are Numba-compiled: each replaces two to five numpy passes and their temporaries with one
loop. The matrix products stay with numpy's BLAS, which no hand loop beats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

DTYPE = np.float32


# --- fused kernels ------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _bias_relu(z: np.ndarray, b: np.ndarray, relu: bool) -> None:  # pragma: no cover (jitted)
    """``z += b`` row-wise, then ``z = max(z, 0)`` if ``relu``; in place."""
    rows, cols = z.shape
    for i in range(rows):
        for j in range(cols):
            v = z[i, j] + b[j]
            if relu and v < 0:
                v = 0
            z[i, j] = v


@numba.njit(cache=True, nogil=True)
def _relu_backward(dh: np.ndarray, h: np.ndarray) -> None:  # pragma: no cover (jitted)
    """``dh *= (h > 0)`` in place: the gradient through a relu whose output was ``h``."""
    flat_d = dh.reshape(-1)
    flat_h = h.reshape(-1)
    for i in range(flat_d.size):
        if flat_h[i] <= 0:
            flat_d[i] = 0


@numba.njit(cache=True, nogil=True)
def _softmax_xent(
    logits: np.ndarray, labels: np.ndarray, scale: float, dlogits: np.ndarray
) -> tuple[float, int]:  # pragma: no cover (jitted)
    """Softmax cross-entropy of each row of ``logits`` against ``labels``.

    Writes ``scale * d(sum of losses)/d(logits)`` into ``dlogits`` and returns the sum of the
    losses (accumulated in float64) and the number of rows whose argmax is the label.
    """
    rows, cols = logits.shape
    total = 0.0
    correct = 0
    for i in range(rows):
        best = 0
        top = logits[i, 0]
        for j in range(1, cols):
            if logits[i, j] > top:
                top = logits[i, j]
                best = j
        y = labels[i]
        if best == y:
            correct += 1
        s = 0.0
        for j in range(cols):
            e = np.exp(np.float64(logits[i, j] - top))
            dlogits[i, j] = e
            s += e
        total += np.log(s) - (logits[i, y] - top)
        inv = scale / s
        for j in range(cols):
            dlogits[i, j] = dlogits[i, j] * inv
        dlogits[i, y] -= scale
    return total, correct


@numba.njit(cache=True, nogil=True)
def _sgd_momentum(
    params: np.ndarray, grads: np.ndarray, velocity: np.ndarray, lr: float, momentum: float
) -> None:  # pragma: no cover (jitted)
    """``v = momentum * v + g; p -= lr * v`` over flat arrays, in one pass."""
    lr32 = np.float32(lr)
    m32 = np.float32(momentum)
    for i in range(params.size):
        v = m32 * velocity[i] + grads[i]
        velocity[i] = v
        params[i] -= lr32 * v


def warm_kernels() -> None:
    """Compile (or load from numba's cache) the kernels; call before starting ranks."""
    z = np.zeros((2, 3), DTYPE)
    _bias_relu(z, np.zeros(3, DTYPE), True)
    _relu_backward(z, z)
    _softmax_xent(z, np.zeros(2, np.int64), 1.0, np.empty_like(z))
    flat = np.zeros(4, DTYPE)
    _sgd_momentum(flat, flat.copy(), flat.copy(), 0.1, 0.9)


# --- the model ----------------------------------------------------------------------------------
class MLP:
    """A ReLU multilayer perceptron with flat parameter and gradient buffers.

    Args:
        sizes: layer widths, input first and classes last, e.g. ``(784, 256, 128, 10)``.
        seed: initialisation seed (He-normal weights, zero biases); equal seeds give bitwise
            equal models.
        grad_buffer: optional flat float32 array of at least :attr:`num_params` elements to hold
            the gradients (its first ``num_params`` elements); lets a trainer append extra
            values behind the gradients and reduce everything in one call.
    """

    def __init__(self, sizes: Sequence[int], seed: int = 0, grad_buffer: np.ndarray | None = None) -> None:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"sizes must be at least two positive widths, got {sizes}")
        self.sizes = sizes
        self.num_params = sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:], strict=True))
        self.params = np.zeros(self.num_params, DTYPE)
        if grad_buffer is None:
            grad_buffer = np.zeros(self.num_params, DTYPE)
        elif grad_buffer.dtype != DTYPE or grad_buffer.ndim != 1 or grad_buffer.size < self.num_params:
            raise ValueError(f"grad_buffer must be a flat float32 array of at least {self.num_params} elements")
        self.grads = grad_buffer[: self.num_params]
        self.weights: list[np.ndarray] = []
        self.biases: list[np.ndarray] = []
        self.grad_weights: list[np.ndarray] = []
        self.grad_biases: list[np.ndarray] = []
        at = 0
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
            for store, grad_store, shape in (
                (self.weights, self.grad_weights, (fan_in, fan_out)),
                (self.biases, self.grad_biases, (fan_out,)),
            ):
                n = int(np.prod(shape))
                store.append(self.params[at : at + n].reshape(shape))
                grad_store.append(self.grads[at : at + n].reshape(shape))
                at += n
        rng = np.random.default_rng(seed)
        for w in self.weights:
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / w.shape[0])
        self._acts: list[np.ndarray] = []

    @property
    def num_layers(self) -> int:
        """The number of dense layers."""
        return len(self.weights)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Logits for the rows of ``x`` (shape ``(batch, sizes[0])``, float32); keeps the
        activations for :meth:`backward`."""
        h = x
        self._acts = [x]
        last = self.num_layers - 1
        for layer, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            z = h @ w
            _bias_relu(z, b, layer != last)
            h = z
            self._acts.append(h)
        return h

    def backward(self, dlogits: np.ndarray) -> None:
        """Write the gradients of the loss whose gradient w.r.t. the last :meth:`forward`'s logits
        is ``dlogits`` into :attr:`grads` (overwriting, not accumulating)."""
        dz = dlogits
        for layer in range(self.num_layers - 1, -1, -1):
            h_in = self._acts[layer]
            np.matmul(h_in.T, dz, out=self.grad_weights[layer])
            np.sum(dz, axis=0, out=self.grad_biases[layer])
            if layer > 0:
                dh = dz @ self.weights[layer].T
                _relu_backward(dh, h_in)
                dz = dh

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray, scale: float) -> tuple[float, int]:
        """Forward and backward on one batch.

        The gradients written are ``scale`` times those of the *sum* of the per-example
        cross-entropy losses (``scale = 1 / batch`` gives the mean loss's gradient). Returns the
        sum of the losses and the number of correct predictions.
        """
        logits = self.forward(x)
        dlogits = np.empty_like(logits)
        loss_sum, correct = _softmax_xent(logits, labels, scale, dlogits)
        self.backward(dlogits)
        return float(loss_sum), int(correct)

    def evaluate(self, x: np.ndarray, labels: np.ndarray, chunk: int = 1024) -> tuple[float, int]:
        """Sum of the losses and number of correct predictions over ``x`` (no gradients)."""
        loss_sum = 0.0
        correct = 0
        for start in range(0, len(x), chunk):
            logits = self.forward(x[start : start + chunk])
            scratch = np.empty_like(logits)
            part_loss, part_correct = _softmax_xent(logits, labels[start : start + chunk], 0.0, scratch)
            loss_sum += part_loss
            correct += part_correct
        self._acts = []
        return float(loss_sum), int(correct)


class SGD:
    """SGD with momentum (PyTorch's form: ``v = momentum * v + g``, ``p -= lr * v``) over flat
    parameter and gradient arrays."""

    def __init__(self, params: np.ndarray, grads: np.ndarray, lr: float, momentum: float = 0.0) -> None:
        if params.shape != grads.shape or params.dtype != grads.dtype:
            raise ValueError("params and grads must have the same shape and dtype")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.params = params
        self.grads = grads
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.velocity = np.zeros_like(params)

    def step(self) -> None:
        """Apply one update from the current gradients."""
        _sgd_momentum(self.params, self.grads, self.velocity, self.lr, self.momentum)
