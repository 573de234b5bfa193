import PlacementSemantics.Basic

/-!
# Activation exchange

Two devices along an axis that splits a layer's computation. Mirrors `activations.*` in
`proofs/` (`proofs/activations.md`), where z3 decides the same for the derived step programs
at degrees 2 to 4 (`formal/_activation_flow.py`).
-/

namespace PlacementSemantics

/-- With the all-reduce, both devices hold the single-device value, the sum of the partial
contributions. -/
theorem all_reduce_completes_partial_sums (x y : Int) : allReduce2 x y = (x + y, x + y) := rfl

/-- Without it, a device keeps its own partial sum, which differs from the single-device value
whenever the other device's contribution is not zero. -/
theorem partial_sum_differs_without_reduction (x y : Int) (hy : y ≠ 0) : x ≠ x + y := by
  omega

/-- An all-reduce applied twice sums two complete copies: twice the single-device value. -/
theorem all_reduce_twice_doubles (x y : Int) : (allReduce2 (allReduce2 x y).1 (allReduce2 x y).2).1 = 2 * (x + y) := by
  simp only [allReduce2] <;> omega

/-- An all-to-all applied twice sends every token back to where it came from. -/
theorem all_to_all_twice_is_identity (a b : Int × Int) :
    allToAll2 (allToAll2 a b).1 (allToAll2 a b).2 = (a, b) := by
  cases a
  cases b
  rfl

/-- One all-to-all delivers to device 0 the token device 1 addressed to it. -/
theorem all_to_all_delivers (a b : Int × Int) : ((allToAll2 a b).1).2 = b.1 := rfl

end PlacementSemantics
