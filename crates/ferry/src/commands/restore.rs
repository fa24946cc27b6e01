//! `ferry restore --dir DIR`

use anyhow::{Context, Result};
use ferry_engine::restore::{load, restore, RestoreReport};
use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Directory holding the image.
    #[arg(long)]
    pub dir: PathBuf,
    /// Print a machine-readable report.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    read_ms: f64,
    total_ms: f64,
    image_data_bytes: u64,
    #[serde(flatten)]
    restore: RestoreReport,
}

pub fn run(a: Args) -> Result<()> {
    let t0 = Instant::now();
    let path = a.dir.join(ferry_image::IMAGE_FILE);
    let file =
        std::fs::File::open(&path).with_context(|| format!("open image {}", path.display()))?;
    let img = load(BufReader::with_capacity(8 << 20, file))
        .with_context(|| format!("read image {}", path.display()))?;
    let read_ms = t0.elapsed().as_secs_f64() * 1e3;
    let report = restore(&img).with_context(|| format!("restore from {}", path.display()))?;
    let report = Report {
        read_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1e3,
        image_data_bytes: img.data_bytes,
        restore: report,
    };
    if a.json {
        super::print_json(&report)?;
    } else {
        println!("{}", report.restore.root_pid);
    }
    Ok(())
}
