"""Memory: what fastlazy holds is freed when the program lets go of it.

- LazyTensor and Segment take part in the cycle collector, so cycles
  through a LazyTensor (its value's attributes, a failed flush's traceback,
  whose frames hold the LazyTensors that hold the failed segment) are
  collected as eager's are;
- a discarded op lets go of the eager tensors it read at once (the node
  dies and its input slots drop their values), not at the next flush.

Objects are watched through weak references, not the process's RSS."""
import gc
import weakref

import pytest
import torch

import fastlazy
from fastlazy import _core


def _failing_step(watch):
    a = torch.rand(1 << 16)
    watch.append(weakref.ref(a))
    y = torch.gather(fastlazy.lazy(a) * 2, 0, fastlazy.lazy(torch.tensor([5])) * 10**7)
    return y.to_eager()        # index out of range: the flush fails


def test_a_caught_failed_flush_is_freed(lazy_on, backend):
    watch = []
    for _ in range(20):
        with pytest.raises((RuntimeError, IndexError)):
            _failing_step(watch)
    gc.collect()
    assert [w() for w in watch if w() is not None] == []


def test_other_tensors_of_a_failed_graph_still_read(lazy_on, backend):
    a = fastlazy.lazy(torch.arange(4.0))
    ok = a + 1
    bad = torch.gather(a * 2, 0, fastlazy.lazy(torch.tensor([5])) * 10**7)
    with pytest.raises((RuntimeError, IndexError)):
        bad.to_eager()
    assert torch.equal(ok.to_eager(), torch.arange(4.0) + 1)


def test_cycle_through_the_value_is_collected(lazy_on, backend):
    refs = []
    for _ in range(5):
        lt = fastlazy.lazy(torch.rand(1000)) * 1
        v = lt.to_eager()
        v.owner = lt                       # value -> its LazyTensor -> value
        refs.append(weakref.ref(lt))
        del lt, v
    gc.collect()
    assert all(r() is None for r in refs)


def test_cycle_through_closures_is_collected(lazy_on, backend):
    refs = []
    for _ in range(5):
        lt = fastlazy.lazy(torch.rand(10)) * 2
        lt.to_eager().callbacks = [lambda: lt.sum()]   # a closure over lt
        refs.append(weakref.ref(lt))
        del lt
    w = torch.rand(10, requires_grad=True)
    leaf = fastlazy.lazy(w)
    leaf.register_hook(lambda g, leaf=leaf: g)         # as eager collects it
    refs.append(weakref.ref(leaf))
    del leaf, w
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_pending_tensor_in_a_cycle_is_collected_after_its_flush(lazy_on, backend):
    class Box:
        pass
    box = Box()
    box.t = fastlazy.lazy(torch.ones(3)) * 2
    box.me = box
    ref = weakref.ref(box.t)
    box.t.to_eager()
    del box
    gc.collect()
    assert ref() is None


def test_discarded_ops_let_go_of_their_inputs(lazy_on, backend):
    a = fastlazy.lazy(torch.rand(1000))
    refs = []
    for _ in range(50):
        fresh = torch.rand(1000)
        refs.append(weakref.ref(fresh))
        a + fresh                          # recorded, never read
        del fresh
    assert _core.pending_nodes() == 0
    assert all(r() is None for r in refs)  # no collection needed


def test_a_dead_node_inside_the_buffer_lets_go_too(lazy_on, backend):
    a = fastlazy.lazy(torch.ones(3))
    f1, f2 = torch.full((3,), 1.0), torch.full((3,), 2.0)
    r1 = weakref.ref(f1)
    b = a + f1
    c = a + f2
    del f1, b                              # not at the end of the buffer
    assert r1() is None
    assert torch.equal(c.to_eager(), torch.full((3,), 3.0))


def test_values_read_again_after_their_slot_was_let_go(lazy_on, backend):
    x = fastlazy.lazy(torch.arange(3.0))
    e = torch.ones(3)
    for k in range(3):
        y = x + e
        del y                              # x's and e's slots lose their uses
        z = x * 2 + e + k
        assert torch.equal(z.to_eager(), torch.arange(3.0) * 2 + 1 + k)


def test_killing_stops_at_live_nodes(lazy_on, backend):
    a = fastlazy.lazy(torch.ones(2))
    y = a * 2
    z = y + 1
    w = y + 2
    del z
    u = w * y
    assert torch.equal(u.to_eager(), torch.full((2,), 8.0))
    assert torch.equal(y.to_eager(), torch.full((2,), 2.0))


def test_a_long_discarded_chain_frees_every_input(lazy_on, backend):
    x = fastlazy.lazy(torch.zeros(4))
    refs = []
    for _ in range(2000):
        e = torch.ones(4)
        refs.append(weakref.ref(e))
        x = x + e
        del e
    del x
    assert _core.pending_nodes() == 0
    assert all(r() is None for r in refs)


def test_only_handles_that_can_close_a_cycle_are_tracked(lazy_on, backend):
    """A pending handle holds nothing a cycle can pass through, so the
    recording path leaves it out of the cycle collector (every recorded op
    makes one); it joins once it holds a value or an attribute."""
    a = fastlazy.lazy(torch.ones(3))
    assert gc.is_tracked(a)                 # holds an eager value
    pending = a * 2
    assert not gc.is_tracked(pending)
    pending.to_eager()
    assert gc.is_tracked(pending)
    tagged = a + 1
    tagged.tag = "x"
    assert gc.is_tracked(tagged)
    again = a - 1                           # a recycled handle starts afresh
    assert not gc.is_tracked(again) and not hasattr(again, "tag")


def test_a_cycle_through_a_pending_handles_attribute_is_collected(lazy_on, backend):
    refs = []
    for _ in range(5):
        t = fastlazy.lazy(torch.ones(3)) * 2
        t.me = t                           # pending, and in a cycle of its own
        refs.append(weakref.ref(t))
        del t
    gc.collect()
    assert all(r() is None for r in refs)


def test_handles_from_python_are_tracked(lazy_on, backend):
    made = fastlazy.LazyTensor.__new__(fastlazy.LazyTensor)
    assert gc.is_tracked(made)
