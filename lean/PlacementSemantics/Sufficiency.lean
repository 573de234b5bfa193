import PlacementSemantics.Basic

/-!
# Sufficiency

If every live copy equals the single-device value (state consistency) and the gradient is
all-reduced exactly once (gradient integrity), one data-parallel step maps the invariant to
itself, and by induction on steps distributed training matches single-device training after
every step. Mirrors `sufficiency.step[data*]` and `sufficiency.library[dp]` in `proofs/`
(`proofs/sufficiency.md`). The refresh lemma mirrors `refreshed[...]` (ZeRO-1/2).
-/

namespace PlacementSemantics

/-- Gradient integrity of a reduced gradient: when every read returns the single-device value,
one all-reduce sums exactly the single-device contributions. -/
theorem gradient_integrity_of_reduced (g : Nat → Int → Int) (w : Int) :
    ∀ (copies : List Int) (i : Nat), AllEqual w copies →
      sumContribs g i copies = sumContribs g i (copiesOf w (count copies))
  | [], _, _ => rfl
  | c :: cs, i, h => by
    cases h with
    | cons _ _ hc hcs =>
      show g i c + sumContribs g (i + 1) cs = g i w + sumContribs g (i + 1) (copiesOf w (count cs))
      rw [hc, gradient_integrity_of_reduced g w cs (i + 1) hcs]

/-- Every replica updated with the same gradient stays equal to the single-device update. -/
theorem allEqual_update (lr G w : Int) {copies : List Int} (h : AllEqual w copies) :
    AllEqual (w - lr * G) (update lr G copies) := by
  induction h with
  | nil => exact AllEqual.nil
  | cons c cs hc _ ih =>
    show AllEqual (w - lr * G) ((c - lr * G) :: update lr G cs)
    exact AllEqual.cons (c - lr * G) (update lr G cs) (by rw [hc]) ih

/-- Updating does not change the number of devices. -/
theorem count_update (lr G : Int) : ∀ copies : List Int, count (update lr G copies) = count copies
  | [] => rfl
  | _ :: cs => by
    show count (update lr G cs) + 1 = count cs + 1
    rw [count_update lr G cs]

theorem count_dpStep (lr : Int) (g : Nat → Int → Int) (copies : List Int) :
    count (dpStep lr g copies) = count copies :=
  count_update lr (reduced g copies) copies

/-- The inductive step: gradient integrity (one all-reduce) and state consistency (all copies
equal the single-device value) before a step imply state consistency after it, with the
single-device value after the step. -/
theorem matches_single_device_of_integrity_and_consistency (lr : Int) (g : Nat → Int → Int)
    (copies : List Int) (w : Int) (h : AllEqual w copies) :
    AllEqual (singleStep lr g (count copies) w) (dpStep lr g copies) := by
  show AllEqual (w - lr * sumContribs g 0 (copiesOf w (count copies)))
    (update lr (sumContribs g 0 copies) copies)
  rw [gradient_integrity_of_reduced g w copies 0 h]
  exact allEqual_update lr _ w h

/-- Hence for all steps: distributed training matches single-device training after `k` steps. -/
theorem matches_single_device_all_steps (lr : Int) (g : Nat → Int → Int) :
    ∀ (k : Nat) (copies : List Int) (w : Int), AllEqual w copies →
      AllEqual (singleSteps lr g (count copies) k w) (dpSteps lr g k copies)
  | 0, _, _, h => h
  | k + 1, copies, w, h => by
    have h1 := matches_single_device_of_integrity_and_consistency lr g copies w h
    have h2 := matches_single_device_all_steps lr g k (dpStep lr g copies) _ h1
    rw [count_dpStep] at h2
    exact h2

/-- `n` copies of `v` all equal `v`. -/
theorem allEqual_copiesOf (v : Int) : ∀ n : Nat, AllEqual v (copiesOf v n)
  | 0 => AllEqual.nil
  | n + 1 => AllEqual.cons v (copiesOf v n) rfl (allEqual_copiesOf v n)

/-- State consistency is restored by the refresh all-gather after a sharded update (ZeRO-1/2):
whatever the stale replicas hold, after the refresh every copy equals the owner's new value. -/
theorem consistent_of_refresh (v : Int) (copies : List Int) : AllEqual v (refresh v copies) :=
  allEqual_copiesOf v (count copies)

end PlacementSemantics
