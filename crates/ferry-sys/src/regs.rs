//! x86_64 register sets as the kernel's ptrace interface exposes them.

/// General-purpose registers, in the kernel's `struct user_regs_struct` order.
pub type GpRegs = libc::user_regs_struct;

/// Number of 64-bit words in [`GpRegs`].
pub const GP_REGS_WORDS: usize = 27;

pub fn gp_to_words(r: &GpRegs) -> Vec<u64> {
    vec![
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi, r.orig_rax, r.rip, r.cs, r.eflags, r.rsp, r.ss, r.fs_base, r.gs_base, r.ds,
        r.es, r.fs, r.gs,
    ]
}

pub fn gp_from_words(w: &[u64]) -> Option<GpRegs> {
    if w.len() != GP_REGS_WORDS {
        return None;
    }
    Some(GpRegs {
        r15: w[0],
        r14: w[1],
        r13: w[2],
        r12: w[3],
        rbp: w[4],
        rbx: w[5],
        r11: w[6],
        r10: w[7],
        r9: w[8],
        r8: w[9],
        rax: w[10],
        rcx: w[11],
        rdx: w[12],
        rsi: w[13],
        rdi: w[14],
        orig_rax: w[15],
        rip: w[16],
        cs: w[17],
        eflags: w[18],
        rsp: w[19],
        ss: w[20],
        fs_base: w[21],
        gs_base: w[22],
        ds: w[23],
        es: w[24],
        fs: w[25],
        gs: w[26],
    })
}

pub fn zeroed_gp() -> GpRegs {
    gp_from_words(&[0; GP_REGS_WORDS]).expect("right length")
}
