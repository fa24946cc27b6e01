//! PAGEMAP_SCAN (an ioctl on /proc/PID/pagemap, Linux 6.7): which pages of a range were
//! written since they were last write-protected through a `FEATURE_WP_ASYNC` userfaultfd,
//! write-protecting them again in the same walk. This kernel has no soft-dirty bits; this is
//! how dirty pages are tracked instead.

use crate::{SysError, SysResult};
use std::os::fd::AsRawFd;

// _IOWR('f', 16, struct pm_scan_arg), the struct being 96 bytes.
const PAGEMAP_SCAN: u64 = 0xc060_6610;
/// Write-protect the pages that match (and are reported).
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// Fail (EPERM) unless every mapping of the range is registered for async write protection.
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
/// The page was written since it was last write-protected (or was never protected).
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
/// The page is present in memory.
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
/// The page is swapped out.
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;

#[repr(C)]
struct ScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// Regions asked for per ioctl; a walk that fills them continues where it stopped.
const REGIONS: usize = 512;

/// The ranges `[start, end)` of `[start, end)` whose pages were written since they were last
/// write-protected, write-protecting them again (atomically, page by page, in one walk): a
/// write after this call is seen by the next. `pagemap` is the process's /proc/PID/pagemap;
/// the range must lie in mappings registered with a `FEATURE_WP_ASYNC` userfaultfd.
pub fn scan_written(pagemap: &std::fs::File, start: u64, end: u64) -> SysResult<Vec<(u64, u64)>> {
    scan(
        pagemap,
        start,
        end,
        PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
        PAGE_IS_WRITTEN,
        0,
    )
}

/// The ranges of `[start, end)` whose pages are present in memory or swapped out (as the
/// pagemap's PM_PRESENT and PM_SWAPPED bits say, page by page), in one walk of the page
/// tables that returns ranges, not a word per page: for a mapping of gigabytes, a few
/// milliseconds less in every freeze. `pagemap` is the process's /proc/PID/pagemap.
pub fn scan_present(pagemap: &std::fs::File, start: u64, end: u64) -> SysResult<Vec<(u64, u64)>> {
    scan(pagemap, start, end, 0, 0, PAGE_IS_PRESENT | PAGE_IS_SWAPPED)
}

fn scan(
    pagemap: &std::fs::File,
    start: u64,
    end: u64,
    flags: u64,
    all_of: u64,
    any_of: u64,
) -> SysResult<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut regions = [PageRegion::default(); REGIONS];
    let mut at = start;
    while at < end {
        let mut arg = ScanArg {
            size: std::mem::size_of::<ScanArg>() as u64,
            flags,
            start: at,
            end,
            walk_end: 0,
            vec: regions.as_mut_ptr() as u64,
            vec_len: REGIONS as u64,
            max_pages: 0,
            category_inverted: 0,
            category_mask: all_of,
            category_anyof_mask: any_of,
            return_mask: all_of | any_of,
        };
        // SAFETY: `arg` is the kernel's struct pm_scan_arg (its size given in `size`), alive
        // and mutably borrowed for the call; `vec` points to `regions`, an array of REGIONS
        // struct page_region the kernel writes at most `vec_len` of.
        let n = unsafe {
            libc::ioctl(
                pagemap.as_raw_fd(),
                PAGEMAP_SCAN as _,
                &mut arg as *mut ScanArg,
            )
        };
        if n < 0 {
            return Err(SysError::last("ioctl(PAGEMAP_SCAN)"));
        }
        for r in &regions[..n as usize] {
            match out.last_mut() {
                Some(last) if last.1 == r.start => last.1 = r.end,
                _ => out.push((r.start, r.end)),
            }
        }
        if arg.walk_end <= at {
            break;
        }
        at = arg.walk_end;
    }
    Ok(out)
}
