//! Queries asked of every process of a tree at once: one injected call per process per
//! round (`ferry_inject::together`), the answers read from each process's scratch memory.

use crate::error::Result;
use ferry_inject::Injector;

/// For each round `k` of `rounds`, the call `call(k, inj)` (name, number, arguments; its
/// answer `len` bytes at scratch offset 0) made in every process of `injs` (ours PIDs and
/// main threads' injectors) at once. The answers, per process, then per round.
pub fn ask_all(
    injs: &[(i32, &Injector)],
    rounds: usize,
    len: usize,
    call: impl Fn(usize, &Injector) -> (&'static str, i64, [u64; 6]),
) -> Result<Vec<Vec<Vec<u8>>>> {
    let mut out: Vec<Vec<Vec<u8>>> = injs.iter().map(|_| Vec::with_capacity(rounds)).collect();
    for k in 0..rounds {
        let items: Vec<ferry_inject::together::Item> = injs
            .iter()
            .map(|(_, inj)| {
                let (name, nr, args) = call(k, inj);
                (*inj, name, nr, args)
            })
            .collect();
        let results = ferry_inject::together::syscalls(&items)?;
        for ((((pid, inj), r), answers), item) in injs.iter().zip(results).zip(&mut out).zip(&items)
        {
            if (-4095..0).contains(&r) {
                return Err(crate::Error::Sys {
                    pid: *pid,
                    what: format!("injected {} (query {k} of {rounds})", item.1),
                    source: ferry_sys::SysError::new(item.1, (-r) as i32),
                });
            }
            answers.push(inj.read_scratch(0, len)?);
        }
    }
    Ok(out)
}
