fn main() {
    // The controller lands with its own issue; the binary exists so the workspace builds.
}
