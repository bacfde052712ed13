"""Actor basics, written the way a Ray user writes them.

Swap ``import pmetal`` for ``import ray`` and ``pmetal.`` for ``ray.`` and
this script runs on Ray unchanged. It shows:

1. a stateful actor (a counter), named and found again with ``get_actor``;
2. remote functions, ``put``, and ObjectRefs passed as arguments;
3. ``wait``: take results as they finish, or give up after a timeout;
4. a synchronous parameter server (the pattern of Ray's parameter-server
   example): data workers compute gradients on their shard of numpy data,
   the server averages them and updates the weights;
5. an exception raised in an actor, caught in the driver as its own type.

Run it with ``python examples/actors_basics.py``: ``pmetal.init()`` starts
a private node on this machine and stops it when the script ends. With a
node already running (``pmetal start``), use ``pmetal.init(address="auto")``.
"""

import time

import numpy as np

import pmetal

# ---------------------------------------------------------------- 1. actors


@pmetal.remote
class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, by=1):
        self.value += by
        return self.value

    def read(self):
        return self.value

    def divide(self, by):
        if by == 0:
            raise ValueError("cannot divide the counter by zero")
        return self.value / by


# ------------------------------------------------------ 2. remote functions


@pmetal.remote
def square(x):
    return x * x


@pmetal.remote
def chunk_sum(data, start, stop):
    return float(data[start:stop].sum())


@pmetal.remote
def sleep_then_return(seconds, label):
    time.sleep(seconds)
    return label


# ------------------------------------------------- 4. parameter server


@pmetal.remote
class ParameterServer:
    def __init__(self, dim, learning_rate):
        self.weights = np.zeros(dim)
        self.learning_rate = learning_rate

    def apply_gradients(self, *gradients):
        self.weights -= self.learning_rate * np.mean(gradients, axis=0)
        return self.weights

    def get_weights(self):
        return self.weights


@pmetal.remote
class DataWorker:
    """Holds one shard of a linear-regression problem y = x @ true_w."""

    def __init__(self, true_weights, seed, samples=256):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(samples, len(true_weights)))
        self.y = self.x @ true_weights

    def compute_gradients(self, weights):
        error = self.x @ weights - self.y
        return self.x.T @ error / len(self.y)

    def loss(self, weights):
        return float(np.mean((self.x @ weights - self.y) ** 2))


def main():
    pmetal.init()
    started = time.perf_counter()

    # 1. A counter: calls from one caller run in order.
    counter = Counter.options(name="global_counter").remote(start=0)
    refs = [counter.increment.remote() for _ in range(10)]
    print("counter increments:", pmetal.get(refs))
    same_counter = pmetal.get_actor("global_counter")
    print("counter via get_actor:", pmetal.get(same_counter.read.remote()))

    # 2. Remote functions. An ObjectRef argument is resolved before the call
    #    runs, but .remote() does not wait for it: the inner squares run side
    #    by side, and each outer one as soon as its argument is ready.
    print("squares:", pmetal.get([square.remote(i) for i in range(5)]))
    print("fourth powers:", pmetal.get([square.remote(square.remote(i)) for i in range(5)]))
    data = pmetal.put(np.arange(1_000_000, dtype=np.float64))
    sums = pmetal.get([chunk_sum.remote(data, i * 250_000, (i + 1) * 250_000)
                       for i in range(4)])
    print("sum of 0..999999 in four chunks:", int(sum(sums)))

    # 3. wait: a timeout returns what is ready so far; num_returns=1 takes
    #    results one by one as they finish.
    slow = sleep_then_return.remote(1.0, "slow")
    ready, not_ready = pmetal.wait([slow], timeout=0.1)
    print(f"after 0.1 s: {len(ready)} ready, {len(not_ready)} pending")
    pending = [slow, sleep_then_return.remote(0.1, "quick")]
    finished = []
    while pending:
        ready, pending = pmetal.wait(pending, num_returns=1)
        finished.append(pmetal.get(ready[0]))
    print("wait collected:", sorted(finished))

    # 4. Synchronous parameter server over numpy arrays.
    dim = 50
    true_weights = np.random.default_rng(0).normal(size=dim)
    ps = ParameterServer.remote(dim, learning_rate=0.5)
    workers = [DataWorker.remote(true_weights, seed) for seed in (1, 2)]
    weights = ps.get_weights.remote()
    first_loss = np.mean(pmetal.get([w.loss.remote(weights) for w in workers]))
    for _ in range(30):
        gradients = [w.compute_gradients.remote(weights) for w in workers]
        weights = ps.apply_gradients.remote(*gradients)
    final = pmetal.get(weights)
    last_loss = np.mean(pmetal.get([w.loss.remote(final) for w in workers]))
    print(f"parameter server: loss {first_loss:.3f} -> {last_loss:.6f}, "
          f"max weight error {np.abs(final - true_weights).max():.2e}")
    assert last_loss < first_loss / 100

    # 5. An exception in an actor comes back as the same exception type.
    try:
        pmetal.get(counter.divide.remote(0))
    except ValueError as exc:
        print("caught ValueError from the actor:", str(exc).splitlines()[0])

    print(f"cluster resources: {sorted(pmetal.cluster_resources())}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    pmetal.shutdown()


if __name__ == "__main__":
    main()
