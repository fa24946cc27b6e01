//! One module per subcommand.

pub mod checkpoint;
pub mod image;
pub mod restore;

/// Prints a report as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
