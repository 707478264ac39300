use clap::Parser;

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let cli = deepinfer::cli::Cli::parse();
    if let Err(err) = deepinfer::cli::run(cli) {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
