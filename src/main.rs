use std::process::ExitCode;

fn main() -> ExitCode {
    gpufit::cli::main()
}
