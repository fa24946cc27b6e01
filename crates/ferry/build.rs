//! The `ferry` binary is linked as a position-dependent executable (`-no-pie`): every `ferry`
//! command is a process start, and a PIE of this size makes the dynamic loader apply about
//! 22,000 relative relocations (a page fault and a page copy for each page of pointers they
//! touch) before `main`. Linked at a fixed address, those pointers are final in the file.
//! The code is still compiled position-independent; only the executable's own load address is
//! fixed (its libraries, heap, stacks and mappings stay randomized). See docs/benchmarks.md.

fn main() {
    println!("cargo:rustc-link-arg-bins=-no-pie");
    println!("cargo:rerun-if-changed=build.rs");
}
