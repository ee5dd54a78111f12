import numpy as np
import pytest

from titan_thd.data.sampler import data_state, epoch_order, global_batch_indices, step_from_state


def test_steps_tile_the_concatenated_epochs():
    n, G, seed = 10, 4, 3
    stream = np.concatenate([epoch_order(n, seed, e, True) for e in range(3)])
    for step in range(7):  # step 2 crosses epoch 0 -> 1, step 4 crosses 1 -> 2
        np.testing.assert_array_equal(
            global_batch_indices(step, G, n, seed), stream[step * G : (step + 1) * G]
        )


def test_epochs_are_distinct_permutations_and_seeded():
    orders = [epoch_order(50, 7, e, True) for e in range(3)]
    for o in orders:
        np.testing.assert_array_equal(np.sort(o), np.arange(50))
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(epoch_order(50, 8, 0, True), orders[0])
    np.testing.assert_array_equal(global_batch_indices(5, 16, 50, 7), global_batch_indices(5, 16, 50, 7))


def test_no_shuffle_is_sequential():
    np.testing.assert_array_equal(global_batch_indices(2, 4, 10, 0, shuffle=False), [8, 9, 0, 1])


def test_batch_larger_than_dataset_wraps_epochs():
    ids = global_batch_indices(0, 25, 10, 1)
    assert ids.size == 25
    for e in range(2):
        np.testing.assert_array_equal(np.sort(ids[e * 10 : (e + 1) * 10]), np.arange(10))


def test_data_state_and_back():
    state = data_state(7, 4, 10, 5)
    assert state == {"step": 7, "epoch": 2, "cursor": 8, "seed": 5}
    assert step_from_state(state, 4, 10, 5) == 7
    with pytest.raises(ValueError, match="seed 5"):
        step_from_state(state, 4, 10, 6)
    with pytest.raises(ValueError, match="global_batch_size = 3"):
        step_from_state(state, 3, 10, 5)


def test_errors():
    with pytest.raises(ValueError, match="global_batch_size"):
        global_batch_indices(0, 0, 10, 0)
    with pytest.raises(ValueError, match="0 samples"):
        global_batch_indices(0, 4, 0, 0)
    with pytest.raises(ValueError, match="step"):
        global_batch_indices(-1, 4, 10, 0)
