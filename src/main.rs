use clap::Parser;

fn main() {
    let cli = deepinfer::cli::Cli::parse();
    if let Err(err) = deepinfer::cli::run(cli) {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
