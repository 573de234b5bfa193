import PlacementSemantics.Basic

/-!
# Costs

Model-state bytes per device derived from the modes of P, O and G along the data axis, with
`n` devices and `q` parameters per shard (`Psi = n * q`), and ZeRO's bytes per element
(parameters 2, gradients 2, optimizer 12). Mirrors `costs.*` in `proofs/` (`proofs/costs.md`),
where sympy derives the same from `formal/_costs.py` for symbolic degrees.
-/

namespace PlacementSemantics

/-- Elements one device holds: a full copy (`n * q`) when replicated, one shard (`q`)
otherwise (sharded, sharded-with-gather between uses), nothing when offloaded/materialized. -/
def heldElements (m : Mode) (n q : Nat) : Nat :=
  match m with
  | .replicated => n * q
  | .sharded => q
  | .shardedGather => q
  | .materialized => 0
  | .offloaded => 0

/-- Model-state bytes per device: 2 bytes per parameter and gradient, 12 per optimizer state. -/
def modelStateBytes (p o g : Mode) (n q : Nat) : Nat :=
  2 * heldElements p n q + 12 * heldElements o n q + 2 * heldElements g n q

theorem dp_memory_eq_16_psi (n q : Nat) :
    modelStateBytes .replicated .replicated .replicated n q = 16 * (n * q) := by
  simp only [modelStateBytes, heldElements]
  generalize n * q = psi
  omega

theorem zero1_memory_eq (n q : Nat) :
    modelStateBytes .replicated .sharded .replicated n q = 4 * (n * q) + 12 * q := by
  simp only [modelStateBytes, heldElements]
  generalize n * q = psi
  omega

theorem zero2_memory_eq (n q : Nat) :
    modelStateBytes .replicated .sharded .sharded n q = 2 * (n * q) + 14 * q := by
  simp only [modelStateBytes, heldElements]
  generalize n * q = psi
  omega

theorem zero3_memory_eq_16_psi_over_n (n q : Nat) :
    modelStateBytes .shardedGather .sharded .sharded n q = 16 * q := by
  simp only [modelStateBytes, heldElements]
  omega

/-- ZeRO-3 over DP is `n` in memory. -/
theorem dp_memory_eq_n_mul_zero3_memory (n q : Nat) :
    modelStateBytes .replicated .replicated .replicated n q =
      n * modelStateBytes .shardedGather .sharded .sharded n q := by
  rw [dp_memory_eq_16_psi, zero3_memory_eq_16_psi_over_n, Nat.mul_left_comm]

/-- Model-state traffic per step in the ZeRO paper's units (elements, (d-1)/d dropped):
DP all-reduces the gradients (2 Psi); ZeRO-3 all-gathers parameters in forward and in
backward and reduce-scatters gradients (3 Psi). -/
def dpTraffic (psi : Nat) : Nat := 2 * psi

def zero3Traffic (psi : Nat) : Nat := psi + psi + psi

/-- ZeRO-3 over DP is 3/2 in communication. -/
theorem zero3_traffic_eq_three_halves_dp (psi : Nat) : 2 * zero3Traffic psi = 3 * dpTraffic psi := by
  simp only [zero3Traffic, dpTraffic]
  omega

/-- Korthikanti's per-layer activation bytes with tensor parallelism `t`, in units where
`sbh = t * u` and `5as²b = t * v`: the 10sbh of layer inputs stay replicated, the 24sbh of
linear-layer internals and the attention scores are split. -/
def tpActivations (t u v : Nat) : Nat := 10 * (t * u) + 24 * u + 5 * v

/-- With sequence parallelism the 10sbh are split too: sbh(34/t + 5as/(ht)). -/
def tpSpActivations (t u v : Nat) : Nat := 10 * u + 24 * u + 5 * v

theorem tp_sp_activations_eq (t u v : Nat) : tpSpActivations t u v = 34 * u + 5 * v := by
  simp only [tpSpActivations]
  omega

/-- Sequence parallelism never holds more activations than tensor parallelism alone. -/
theorem tp_sp_activations_le_tp (t u v : Nat) (ht : 1 ≤ t) : tpSpActivations t u v ≤ tpActivations t u v := by
  simp only [tpSpActivations, tpActivations]
  have h : 1 * u ≤ t * u := Nat.mul_le_mul_right u ht
  omega

/-- Without a pipeline one device is both stages: `sbh/t + 4sbh/t (1 + v/h)`. -/
theorem io_activations_without_pipeline_eq (u w : Nat) : ioActivations 1 1 u w = 5 * u + 4 * w := by
  simp only [ioActivations] <;> omega

/-- A pipeline's first stage keeps only the dropout mask, `sbh/t` per micro-batch. -/
theorem io_activations_first_stage_eq (u w : Nat) : ioActivations 1 0 u w = u := by
  simp only [ioActivations] <;> omega

/-- A pipeline's last stage keeps only the output layer, `4sbh/t (1 + v/h)`. -/
theorem io_activations_last_stage_eq (u w : Nat) : ioActivations 0 1 u w = 4 * u + 4 * w := by
  simp only [ioActivations] <;> omega

end PlacementSemantics
