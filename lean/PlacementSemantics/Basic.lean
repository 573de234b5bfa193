/-!
# Placement semantics: definitions

States, modes and placements (docs/semantics.md, "Vocabulary"), and one data-parallel training step over
finitely many devices with integer values: each device holds a copy of a parameter, computes
its gradient contribution at the value it read, the contributions are all-reduced (summed), and
every device applies plain SGD. The loss is a sum over samples, so the single-device gradient
is the sum of the per-device contributions at the single-device value (no division: values stay
integers). Mirrors `proofs/_machine.py` (a data axis) and `proofs/_numeric.py`.
-/

namespace PlacementSemantics

/-- How a state is held along one axis. -/
inductive Mode where
  | replicated
  | sharded
  | shardedGather
  | materialized
  | offloaded
  deriving DecidableEq, Repr

/-- The four training states. -/
inductive StateKind where
  | parameters
  | optimizer
  | gradients
  | activations
  deriving DecidableEq, Repr

/-- The placement of one state along one axis: its mode and the offset of its shards
(shard `k` lives on coordinate `(k + offset) % degree`). -/
structure Placement where
  mode : Mode
  offset : Nat
  deriving DecidableEq, Repr

/-- Does coordinate `c` hold shard `k` on an axis of degree `d` with this offset? -/
def owns (d offset k c : Nat) : Bool :=
  (k + offset) % d == c

/-- The sum of a list of integers. -/
def total : List Int → Int
  | [] => 0
  | x :: xs => x + total xs

/-- The number of devices (copies) in a list. -/
def count : List Int → Nat
  | [] => 0
  | _ :: xs => count xs + 1

/-- `n` copies of the value `w`. -/
def copiesOf (w : Int) : Nat → List Int
  | 0 => []
  | n + 1 => w :: copiesOf w n

/-- Every copy equals `w`: the invariant "every live copy equals the single-device value". -/
inductive AllEqual (w : Int) : List Int → Prop
  | nil : AllEqual w []
  | cons (c : Int) (cs : List Int) : c = w → AllEqual w cs → AllEqual w (c :: cs)

/-- The contributions of devices `i, i+1, ...`, each computed at the copy that device read;
`g i c` is device `i`'s contribution at value `c` (any function: any model, any data). -/
def sumContribs (g : Nat → Int → Int) : Nat → List Int → Int
  | _, [] => 0
  | i, c :: cs => g i c + sumContribs g (i + 1) cs

/-- The gradient after one all-reduce (sum) along the data axis. -/
def reduced (g : Nat → Int → Int) (copies : List Int) : Int :=
  sumContribs g 0 copies

/-- The single-device gradient: every contribution at the single-device value `w`. -/
def singleGradient (g : Nat → Int → Int) (w : Int) (n : Nat) : Int :=
  sumContribs g 0 (copiesOf w n)

/-- Plain SGD on every copy with the same gradient `G` and learning rate `lr`. -/
def update (lr G : Int) : List Int → List Int
  | [] => []
  | c :: cs => (c - lr * G) :: update lr G cs

/-- One data-parallel step: read, contribute, all-reduce once, update every replica. -/
def dpStep (lr : Int) (g : Nat → Int → Int) (copies : List Int) : List Int :=
  update lr (reduced g copies) copies

/-- One single-device step on `n` samples (one per device). -/
def singleStep (lr : Int) (g : Nat → Int → Int) (n : Nat) (w : Int) : Int :=
  w - lr * singleGradient g w n

/-- `k` data-parallel steps. -/
def dpSteps (lr : Int) (g : Nat → Int → Int) : Nat → List Int → List Int
  | 0, copies => copies
  | k + 1, copies => dpSteps lr g k (dpStep lr g copies)

/-- `k` single-device steps. -/
def singleSteps (lr : Int) (g : Nat → Int → Int) (n : Nat) : Nat → Int → Int
  | 0, w => w
  | k + 1, w => singleSteps lr g n k (singleStep lr g n w)

/-- A ZeRO-style sharded update: only the owner (index `owner`) applies SGD; the other
replicas keep their old value until a refresh. -/
def shardedUpdate (lr G : Int) (owner : Nat) : Nat → List Int → List Int
  | _, [] => []
  | i, c :: cs => (if i == owner then c - lr * G else c) :: shardedUpdate lr G owner (i + 1) cs

/-- The refresh all-gather: every replica receives the owner's value `v`. -/
def refresh (v : Int) (copies : List Int) : List Int :=
  copiesOf v (count copies)

/-- A list of rows (one per coordinate of a second axis), flattened. -/
def concatAll : List (List Int) → List Int
  | [] => []
  | r :: rs => r ++ concatAll rs

/-- Reduce along the first axis (each row), then along the second (the row sums). -/
def rowSums : List (List Int) → List Int
  | [] => []
  | r :: rs => total r :: rowSums rs

/-- Two devices' halves of an activation after an all-reduce along the axis: each holds the sum
of the partial contributions (Megatron's `g`, a row-parallel output). -/
def allReduce2 (x y : Int) : Int × Int := (x + y, x + y)

/-- An all-to-all between two devices: device 0 sends its second slot to device 1 and receives
device 1's first (expert parallelism's token dispatch). -/
def allToAll2 (a b : Int × Int) : (Int × Int) × (Int × Int) := ((a.1, b.1), (a.2, b.2))

/-- Korthikanti section 4.3 with sequence and tensor parallelism, per micro-batch, in units
`u = sbh/t` and `w = sbv/t`: the first stage keeps the input embeddings' dropout mask (`u`),
the last the final norm's and head's inputs (`4u`) and the fp32 logits (`4w`). `first` and
`last` are 1 when the device is that stage, else 0 (the paper's delta). -/
def ioActivations (first last u w : Nat) : Nat := first * u + last * (4 * u + 4 * w)

end PlacementSemantics

/-! Program semantics (docs/semantics.md, "Gradient buffers", "Gradient integrity", "State
consistency", "Composition rules"); theorems in `Programs.lean`. -/

namespace PlacementSemantics

/-- Gradient accumulation with a SUM all-reduce of each micro-batch's FRESH gradient (each
micro-batch a list of the devices' contributions): what every device's `.grad` holds after the
loop, before the one normalising scale. -/
def freshReduced : List (List Int) → Int
  | [] => 0
  | mb :: rest => total mb + freshReduced rest

/-- The same SUM all-reduce on the ACCUMULATED `.grad` after each micro-batch, on `d` devices
that agree on `acc`: each holds `acc + c_i`, and the all-reduce gives `d * acc + total mb`. -/
def accumulatedReduced (d : Int) : Int → List (List Int) → Int
  | acc, [] => acc
  | acc, mb :: rest => accumulatedReduced d (d * acc + total mb) rest

/-- A forward-phase scale `s` of `.grad` in every micro-batch: it acts on what the earlier
micro-batches accumulated, then the micro-batch's reduced fresh gradient is added. -/
def forwardScaled (s : Int) : Int → List (List Int) → Int
  | acc, [] => acc
  | acc, mb :: rest => forwardScaled s (s * acc + total mb) rest

/-- The product of a list of integer scale factors. -/
def prodList : List Int → Int
  | [] => 1
  | k :: ks => k * prodList ks

/-- A parameter or optimizer state scaled by each factor in turn (the last one first). -/
def scaledBy : List Int → Int → Int
  | [], p => p
  | k :: ks, p => k * scaledBy ks p

/-- A broadcast from the axis's first device: every device takes device 0's value. -/
def broadcast0 : List Int → List Int
  | [] => []
  | c :: cs => copiesOf c (count (c :: cs))

/-- Two devices, two elements: a SUM reduce-scatter leaves device 0 the reduced element 0 and
device 1 the reduced element 1 (each device's contribution is a pair, one per element). -/
def reduceScatter2 (a b : Int × Int) : Int × Int := (a.1 + b.1, a.2 + b.2)

/-- An all-gather of two devices' shards: both hold both shards. -/
def allGather2 (s : Int × Int) : (Int × Int) × (Int × Int) := (s, s)

/-- Linear regression's per-sample gradient, `d/dw (w x - y)^2 / 2`. -/
def sampleGrad (w x y : Int) : Int := (w * x - y) * x

/-- Split computation: device `i` computes only element `i` of the gradient; the elements
outside its slice stay as the zeroed buffer left them. -/
def splitGrad (i : Nat) : Nat → List Int → List Int
  | _, [] => []
  | e, x :: xs => (if e == i then x else 0) :: splitGrad i (e + 1) xs

/-! ## The scalars around the gradients (docs/semantics.md, "Global scalars") -/

/-- A piece of a group's gradient in the global norm: how many devices add its square (after the
all-reduce over the axis), and its square. -/
structure NormPiece where
  adders : Nat
  square : Nat
  deriving DecidableEq, Repr

/-- The squared norm the devices compute: each piece's square times the devices that add it. -/
def countedNorm : List NormPiece → Nat
  | [] => 0
  | p :: ps => p.adders * p.square + countedNorm ps

/-- The single-device squared norm: each piece's square once. -/
def wholeNorm : List NormPiece → Nat
  | [] => 0
  | p :: ps => p.square + wholeNorm ps

/-- The or of the overflow flags a device sees. -/
def anyFlag : List Bool → Bool
  | [] => false
  | b :: bs => b || anyFlag bs

end PlacementSemantics
