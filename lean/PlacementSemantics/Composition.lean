import PlacementSemantics.Basic

/-!
# Composition

Lemmas behind the composition rules (docs/semantics.md, "Composition rules"), each mirroring a
`composition.*` obligation of `proofs/` (`proofs/composition.md`): reducing along two axes in
turn sums every contribution exactly once (rule 2 over a product mesh); shards of one offset
partition the elements (rules 1 and 4); sizes that do not divide lose elements (rule 1).
-/

namespace PlacementSemantics

theorem total_append : ∀ xs ys : List Int, total (xs ++ ys) = total xs + total ys
  | [], ys => by
    show total ys = 0 + total ys
    omega
  | x :: xs, ys => by
    show x + total (xs ++ ys) = x + total xs + total ys
    rw [total_append xs ys]
    omega

/-- Reduction closure on a product mesh: reducing along the first axis (each row) and then
along the second (the row sums) sums every device's contribution exactly once. -/
theorem reduce_along_two_axes_sums_each_contribution_once :
    ∀ rows : List (List Int), total (rowSums rows) = total (concatAll rows)
  | [] => rfl
  | r :: rs => by
    show total r + total (rowSums rs) = total (r ++ concatAll rs)
    rw [total_append, reduce_along_two_axes_sums_each_contribution_once rs]

/-- Devices owning shard `k` on an axis of degree `d` with this offset. -/
def ownersOf (d offset k : Nat) : Nat :=
  ((List.range d).filter (fun c => owns d offset k c)).length

/-- Every shard has exactly one owner, for every offset. -/
def partitionOk (d : Nat) : Bool :=
  (List.range d).all (fun off => (List.range d).all (fun k => ownersOf d off k == 1))

/-- Shards of one partition cover every element exactly once (coverage; alignment compares
two such partitions), on axes of degree 2, 3 and 4. -/
theorem shards_partition_elements : partitionOk 2 = true ∧ partitionOk 3 = true ∧ partitionOk 4 = true := by
  decide

/-- The owner of element `e` of a tensor of `size` elements cut into `d` floor-sized blocks. -/
def blockOwner (size d offset e : Nat) : Option Nat :=
  if size / d == 0 || decide (e ≥ (size / d) * d) then none else some ((e / (size / d) + offset) % d)

/-- Orthogonality (sizes divide): 4 elements over 2 devices are all owned ... -/
theorem divisible_sizes_cover_every_element :
    (List.range 4).all (fun e => (blockOwner 4 2 0 e).isSome) = true := by decide

/-- ... and 3 elements over 2 devices lose the last one (Megatron-LM #1754). -/
theorem indivisible_sizes_lose_an_element : blockOwner 3 2 0 2 = none := by decide

end PlacementSemantics
