import gc
import weakref

from zerotrain.train.heap import FrozenHeap


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_heap_is_collected_and_frozen_once_after_the_warm_up_and_thawed_on_close():
    heap = FrozenHeap(enabled=True, after_steps=2, steps_to_run=10)
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
    first = FrozenHeap(enabled=True, after_steps=0, steps_to_run=10)
    try:
        assert first.step() is not None
    finally:
        first.close()
    off = FrozenHeap(enabled=False, after_steps=2, steps_to_run=10)
    assert [off.step() for _ in range(5)] == [None] * 5
    assert gc.get_freeze_count() == 0
    off.close()


def test_no_freeze_when_no_step_would_follow_it():
    heap = FrozenHeap(enabled=True, after_steps=3, steps_to_run=3)
    assert [heap.step() for _ in range(3)] == [None] * 3 and gc.get_freeze_count() == 0
    heap.close()


def test_a_heap_the_caller_froze_is_left_as_the_caller_froze_it():
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        heap = FrozenHeap(enabled=True, after_steps=1, steps_to_run=10)
        assert heap.step() is None  # the caller manages the collector
        heap.close()
        assert gc.get_freeze_count() == theirs
    finally:
        gc.unfreeze()
