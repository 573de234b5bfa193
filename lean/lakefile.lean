import Lake
open Lake DSL

-- Lean 4 core only: no Mathlib, no Std/Batteries.
package «placement-semantics»

@[default_target]
lean_lib PlacementSemantics
