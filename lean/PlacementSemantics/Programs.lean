import PlacementSemantics.Basic
import PlacementSemantics.Composition

/-!
# Program semantics

Every op on the gradient, the parameters and the optimizer state enters the verdict
(docs/semantics.md). Each theorem mirrors a `programs.*` obligation of `proofs/`
(`proofs/programs.md`), where z3 decides the same over symbolic values and the shipped encoder
is run on the same programs. Scales are stated over integers: a divisor `k` stands for the
scale `1/k`, and "the value times the product of the divisors is the sum" for "the value is the
sum normalised".
-/

namespace PlacementSemantics

/-! ## Normalisation as a product across axes -/

/-- Dividing by `k1` along one axis and by `k2` along another normalises the sum `S` exactly
when the product of the divisors is the single-device normaliser `dp * cp`. -/
theorem product_of_divisors_normalises (dp cp k1 k2 : Nat) (mean S : Int)
    (hmean : mean * ((dp * cp : Nat) : Int) = S) (hk : k1 * k2 = dp * cp) :
    mean * ((k1 * k2 : Nat) : Int) = S := by
  simp only [hk]
  exact hmean

/-- Any other product `k` of divisors: the one-hot contribution is held as `1/k` where single
device training has `1/N`, and those differ since `k ≠ N`. -/
theorem other_product_of_divisors_differs (k N : Nat) (h : k ≠ N) : (k : Int) ≠ (N : Int) := by
  omega

/-- SUM over dp = 2 and cp = 2, then one scale 1/4, gives the mean of the four contributions. -/
theorem sum_over_dp_and_cp_then_one_scale_is_mean :
    total (rowSums [[1, 3], [5, 7]]) / 4 = total (concatAll [[1, 3], [5, 7]]) / (2 * 2) := by
  decide

/-- The same with only the dp divisor (1/2): not the mean. -/
theorem sum_over_dp_and_cp_with_dp_scale_only_differs :
    total (rowSums [[4, 0], [0, 0]]) / 2 ≠ total (concatAll [[4, 0], [0, 0]]) / (2 * 2) := by
  decide

/-! ## Gradient buffers -/

/-- A SUM all-reduce of each micro-batch's fresh gradient, accumulated, is the row-by-row
reduction of the micro-batches' contributions. -/
theorem fresh_reduced_eq_row_sums : ∀ mbs : List (List Int), freshReduced mbs = total (rowSums mbs)
  | [] => rfl
  | mb :: rest => by
    simp only [freshReduced, rowSums, total, fresh_reduced_eq_row_sums rest]

/-- ... so it sums every contribution of every micro-batch exactly once: one scale by the
single-device normaliser then gives the single-device gradient. -/
theorem fresh_reduce_each_micro_batch_sums_every_contribution_once (mbs : List (List Int)) :
    freshReduced mbs = total (concatAll mbs) :=
  (fresh_reduced_eq_row_sums mbs).trans (reduce_along_two_axes_sums_each_contribution_once mbs)

/-- With one micro-batch the fresh gradient is `.grad`: either buffer gives the same. -/
theorem accumulated_reduce_one_micro_batch_agrees (d : Int) (mb : List Int) :
    accumulatedReduced d 0 [mb] = freshReduced [mb] := by
  simp [accumulatedReduced, freshReduced]

/-- The all-reduce on `.grad` after each micro-batch at m = 2, d = 2: micro-batch 0's gradient
goes through it twice (held 2, single-device sum 1). -/
theorem accumulated_reduce_each_micro_batch_differs :
    accumulatedReduced 2 0 [[1, 0], [0, 0]] ≠ freshReduced [[1, 0], [0, 0]] := by
  decide

/-- A forward op on `.grad` at m = 2 acts on the first micro-batch's gradient only. -/
theorem forward_op_on_grad_acts_on_earlier_micro_batches (s : Int) (a b : List Int) :
    forwardScaled s 0 [a, b] = s * total a + total b := by
  simp [forwardScaled]

/-- At m = 1 a forward op on `.grad` acts on the empty buffer: no effect. -/
theorem forward_op_on_grad_no_effect_at_one_micro_batch (s : Int) (a : List Int) :
    forwardScaled s 0 [a] = total a := by
  simp [forwardScaled]

/-! ## Broadcasts and all-gathers of the gradient -/

theorem count_copiesOf (v : Int) : ∀ n : Nat, count (copiesOf v n) = n
  | 0 => rfl
  | n + 1 => by simp only [copiesOf, count, count_copiesOf v n]

/-- A broadcast of a reduced gradient (every device holds `v`) changes nothing. -/
theorem broadcast_of_reduced_gradient_restores_it (v : Int) (n : Nat) :
    broadcast0 (copiesOf v (n + 1)) = copiesOf v (n + 1) := by
  simp only [copiesOf, broadcast0, count, count_copiesOf]

/-- A broadcast of the unreduced gradient, then the sum: device 1's contribution is lost. -/
theorem broadcast_of_unreduced_gradient_loses_contribution : total (broadcast0 [0, 1]) ≠ total [0, 1] := by
  decide

/-- An all-gather of the shards of a SUM reduce-scatter gives both devices the reduced gradient
on both elements. -/
theorem all_gather_of_reduced_shards_restores_gradient (a b : Int × Int) :
    allGather2 (reduceScatter2 a b) = ((a.1 + b.1, a.2 + b.2), (a.1 + b.1, a.2 + b.2)) := rfl

/-! ## Scales of P and O fold -/

theorem scaledBy_eq_product_mul (p : Int) : ∀ ks : List Int, scaledBy ks p = prodList ks * p
  | [] => by simp [scaledBy, prodList]
  | k :: ks => by simp only [scaledBy, prodList, scaledBy_eq_product_mul p ks, Int.mul_assoc]

/-- State consistency: scales whose product is 1 leave the state unchanged. -/
theorem scaled_state_unchanged_of_product_one (ks : List Int) (p : Int) (h : prodList ks = 1) :
    scaledBy ks p = p := by
  simp [scaledBy_eq_product_mul, h]

/-- Any other product changes the state 1. -/
theorem scaled_state_changed_of_product_not_one (ks : List Int) (h : prodList ks ≠ 1) : scaledBy ks 1 ≠ 1 := by
  simp [scaledBy_eq_product_mul, h]

/-- x(-1) then x(-1) restores the state (the product is 1). -/
theorem scale_then_inverse_restores_state : scaledBy [-1, -1] 5 = 5 := by
  decide

/-! ## Data assignment -/

/-- Both devices of a data axis of degree 2 given the same sample: the summed gradient equals
the batch's exactly when the two samples' gradients are equal. -/
theorem replicated_data_matches_batch_iff (g1 g2 : Int) : g1 + g1 = g1 + g2 ↔ g1 = g2 := by
  constructor
  · intro h
    omega
  · intro h
    omega

/-- Two samples of linear regression on which they are not equal: the gradient of half the
batch (twice) is not the gradient of the batch. -/
theorem replicated_data_differs_from_batch :
    sampleGrad 0 1 1 + sampleGrad 0 1 1 ≠ sampleGrad 0 1 1 + sampleGrad 0 1 0 := by
  decide

/-! ## Split computation needs a sharded gradient -/

/-- Sharded: each device reads only its slice, which it computed. -/
theorem split_compute_own_slice_is_full_gradient :
    (splitGrad 0 0 [3, 4]).head? = some 3 ∧ (splitGrad 1 0 [3, 4]).getLast? = some 4 := by
  decide

/-- Replicated: device 0's copy differs from the full gradient outside its slice. -/
theorem split_compute_replica_differs_outside_slice : splitGrad 0 0 [3, 4] ≠ [3, 4] := by
  decide

/-! ## Parameter ops run once per micro-batch -/

/-- A x2 of a nonzero parameter after the first micro-batch's backward: the second
micro-batch's forward reads twice the single-device value. -/
theorem doubled_parameter_second_micro_batch_read_differs (p : Nat) (h : 0 < p) : 2 * p ≠ p := by
  omega

/-- A x1 after every micro-batch's backward changes no read, whatever the micro-batch. -/
theorem unit_scale_keeps_every_micro_batch_read (p m : Nat) : 1 ^ m * p = p := by
  simp

/-! ## Reduce-scatters along several axes nest -/

/-- A 2 x 2 grid: reduce-scattering along one axis and then the other, in either order, gives
the piece the sum of its four contributions. -/
theorem nested_reduce_scatter_order_gives_same_sum (c00 c01 c10 c11 : Int) :
    (c00 + c10) + (c01 + c11) = (c00 + c01) + (c10 + c11) := by
  omega

/-- The second reduce-scatter cut from the whole buffer (as if the first had not run) misses
a contribution: one-hot from device (1, 0), the piece gets 0 where the sum is 1. -/
theorem nested_reduce_scatter_whole_buffer_cut_misses_contribution :
    ((0 : Int) + 0) + 0 ≠ 0 + 0 + 1 + 0 := by
  omega

/-- Reduce-scattered along the inner axis from the whole buffer, device `(0, 1)` keeps the inner
chunk 1, elements `d1` to `2 * d1 - 1`: its piece, element `0 * d2 + 1`, is not among them. -/
theorem inner_chunk_of_whole_misses_outer_piece (d1 d2 : Nat) (h : 2 ≤ d1) :
    ¬ (1 * d1 ≤ 0 * d2 + 1 ∧ 0 * d2 + 1 < 2 * d1) := by
  omega

/-- A 2 x 2 grid: all-reduced along the outer axis, then reduce-scattered along the inner one,
the piece gets the sum of its four contributions. -/
theorem outer_all_reduce_first_gives_same_sum (c00 c01 c10 c11 : Int) :
    (c00 + c10) + (c01 + c11) = c00 + c01 + c10 + c11 := by
  omega

/-- Reduce-scattered along the inner axis within the outer chunk, then all-reduced along the
outer one, device `(0, 1)`'s element 1 gets device `(1, 1)`'s element 3 added: one-hot from
device `(1, 0)` at element 1, the piece gets 0 where the sum is 1. -/
theorem inner_scatter_then_outer_all_reduce_mixes_elements :
    ((0 : Int) + 0) + (0 + 0) ≠ 0 + 0 + 1 + 0 := by
  omega

/-! ## Groups outside the layers along a pipeline -/

/-- A stage that holds a replica of a group it never computes updates it from no gradient: its
copy differs from the computing stage's whenever the step is nonzero. -/
theorem update_without_gradient_differs (p s : Int) (h : s ≠ 0) : p - 0 ≠ p - s := by
  omega

end PlacementSemantics
