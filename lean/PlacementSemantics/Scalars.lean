import PlacementSemantics.Basic

/-!
# The scalars around the gradients

Mirrors `proofs/scalars.py` (docs/semantics.md, "Global scalars"): the global norm counts every
piece once, the overflow decision is an or (duplicates harmless), the mean of micro-batch means
is the global token mean only for equal counts, and an element-wise update after a global scalar
matches single-device training when the gradient and the scalar agree. Token weights are stated
over naturals by cross-multiplication: a token of micro-batch 0 weighs `1/(2 n0)` under the mean
of two means and `1/(n0 + n1)` under the global mean.
-/

namespace PlacementSemantics

/-- Sufficiency: when every piece is added by exactly one device, the all-reduced norm is the
single-device one. -/
theorem counted_norm_of_once : ∀ (ps : List NormPiece), (∀ p ∈ ps, p.adders = 1) →
    countedNorm ps = wholeNorm ps
  | [], _ => rfl
  | p :: ps, h => by
    have hp : p.adders = 1 := h p (List.mem_cons_self p ps)
    have hs : ∀ q ∈ ps, q.adders = 1 := fun q hq => h q (List.mem_cons_of_mem p hq)
    have ih : countedNorm ps = wholeNorm ps := counted_norm_of_once ps hs
    simp only [countedNorm, wholeNorm, hp, Nat.one_mul, ih]

/-- Necessity (`norm_counts_once`): a replica added by two devices (a tp-replicated norm weight)
doubles its share of the norm. -/
theorem replica_counted_twice_differs (x : Nat) (hx : 0 < x) :
    countedNorm [⟨2, x⟩] ≠ wholeNorm [⟨2, x⟩] := by
  show 2 * x + 0 ≠ x + 0
  omega

/-- Necessity (`norm_covers`): a piece no device adds (a stage left out) leaves the norm short. -/
theorem missing_piece_differs (x y : Nat) (hx : 0 < x) :
    countedNorm [⟨0, x⟩, ⟨1, y⟩] ≠ wholeNorm [⟨0, x⟩, ⟨1, y⟩] := by
  show 0 * x + (1 * y + 0) ≠ x + (y + 0)
  omega

/-- The overflow flag: seeing a flag twice is seeing it once (an or of replicas is harmless). -/
theorem duplicate_flag_harmless (b : Bool) (bs : List Bool) :
    anyFlag (b :: b :: bs) = anyFlag (b :: bs) := by
  cases b with
  | false => simp [anyFlag]
  | true => simp [anyFlag]

/-- Necessity (`overflow_reduced`): a device that does not see the other's overflow decides to step. -/
theorem unseen_overflow_differs : anyFlag [false] ≠ anyFlag [false, true] := by
  decide

/-- The mean of two micro-batches' token means gives a token of micro-batch 0 the global weight
exactly when the two counts are equal. -/
theorem mean_of_means_exact_iff (n0 n1 : Nat) : 2 * n0 = n0 + n1 ↔ n0 = n1 := by
  omega

/-- Necessity (`token_count`): unequal counts (50 and 30 tokens) break it. -/
theorem mean_of_means_differs : 2 * 50 ≠ 50 + 30 := by
  decide

/-- Necessity (`logits_placement`): two tp ranks holding the whole vocabulary (gathered logits)
and summing their normalisers give `2 Z`, not `Z`: the loss is off by `log 2`. -/
theorem gathered_logits_double_the_normaliser (z : Nat) (hz : 0 < z) : z + z ≠ z := by
  omega

/-- An element-wise update after a global scalar (the clip factor) matches single-device training
when every device's gradient and scalar are the single-device ones. -/
theorem elementwise_after_scalar (u : Int → Int → Int → Int) (p o g c gi ci : Int)
    (hg : gi = g) (hc : ci = c) : u p o (ci * gi) = u p o (c * g) := by
  simp only [hg, hc]

end PlacementSemantics
