import PlacementSemantics.Basic

/-!
# Necessity

For each kind of violation, a concrete model, data and plain SGD step (integers, decided by
evaluation) on which the distributed result differs from single-device training. Each theorem
mirrors one `necessity.*` obligation of `proofs/` (`proofs/necessity.md`), where z3 constructs
the counterexample and numpy replays it.
-/

namespace PlacementSemantics

/-- A per-device contribution that depends on the value read and on the device's sample. -/
def contrib : Nat → Int → Int := fun i w => w + (i : Int) + 1

/-- A device's buffer of a sharded state: its own shards, zeros elsewhere (a freed buffer). -/
def shardBuffer (d offset device : Nat) : Nat → List Int → List Int
  | _, [] => []
  | k, x :: xs => (if owns d offset k device then x else 0) :: shardBuffer d offset device (k + 1) xs

/-- Missing reduction: a device updates with its own contribution only. -/
theorem missing_reduction_changes_update :
    (1 : Int) - 1 * contrib 0 1 ≠ singleStep 1 contrib 2 1 := by decide

/-- Duplicated reduction: all-reducing an already reduced gradient again doubles it. -/
theorem duplicated_reduction_changes_gradient :
    total [reduced contrib [1, 1], reduced contrib [1, 1]] ≠ singleGradient contrib 1 2 := by decide

/-- Reduction along a complete axis: summing two complete copies doubles the gradient. -/
theorem reduction_on_complete_axis_changes_gradient :
    total (copiesOf (singleGradient contrib 1 2) 2) ≠ singleGradient contrib 1 2 := by decide

/-- Double averaging: dividing by the degree twice. -/
theorem double_averaging_changes_gradient :
    (reduced contrib [1, 1] / 2) / 2 ≠ reduced contrib [1, 1] / 2 := by decide

/-- Stale replica: after a sharded update without the refresh, device 1 still holds the old
value, which its next forward reads. -/
theorem stale_replica_read_differs :
    shardedUpdate 1 5 0 0 [1, 1] ≠ copiesOf (1 - 1 * 5) 2 := by decide

/-- Misaligned shards: with optimizer shards at offset 1 and gradient shards at offset 0,
device 0 updates element 1 but its gradient buffer holds a zero there. -/
theorem misaligned_shards_read_wrong_gradient :
    owns 2 1 1 0 = true ∧ owns 2 0 1 0 = false ∧
      (shardBuffer 2 0 0 0 [5, 7]).getD 1 0 ≠ [5, 7].getD 1 0 := by decide

/-- Sharded read without gather: device 0 reads zeros where device 1's shard should be. -/
theorem sharded_read_without_gather_differs :
    shardBuffer 2 0 0 0 [3, 4] ≠ [3, 4] := by decide

/-- Offloaded parameter not fetched: the device buffer holds nothing (zeros). -/
theorem offloaded_not_fetched_differs :
    copiesOf 0 2 ≠ [3, 4] := by decide

end PlacementSemantics
