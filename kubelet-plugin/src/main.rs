fn main() {
    // Wired up once the driver lands; see lib.rs.
}
