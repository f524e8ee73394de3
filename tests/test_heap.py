import gc
import weakref

from zerotrain.heap import FrozenHeap


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_heap_is_collected_and_frozen_once_after_the_warm_up_and_thawed_on_close():
    heap = FrozenHeap(enabled=True, after_steps=2)
    try:
        assert heap.step() is None and gc.get_freeze_count() == 0  # still in the warm-up
        garbage = _Cycle()
        alive = weakref.ref(garbage)
        del garbage  # a cycle: only a collection frees it
        assert alive() is not None
        took = heap.step()
        assert took is not None and took >= 0
        assert alive() is None  # collected before the freeze, not frozen in for good
        frozen = gc.get_freeze_count()
        assert frozen > 0  # what survived the collection sits in the permanent generation
        assert heap.step() is None and gc.get_freeze_count() == frozen  # once only
    finally:
        heap.close()
    assert gc.get_freeze_count() == 0


def test_no_warm_up_freezes_after_the_first_step_and_off_never_freezes():
    first = FrozenHeap(enabled=True, after_steps=0)
    try:
        assert first.step() is not None
    finally:
        first.close()
    off = FrozenHeap(enabled=False, after_steps=2)
    assert [off.step() for _ in range(5)] == [None] * 5
    assert gc.get_freeze_count() == 0
    off.close()
