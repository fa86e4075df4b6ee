// Command fake-cri is a thin fake CRI runtime for migdra's end-to-end tests.
//
// It serves the CRI v1 RuntimeService and ImageService on a unix socket so
// that the real upstream kubelet can run pods without any real containers.
// It is built on the fakes shipped by k8s.io/cri-api (FakeRuntimeService,
// FakeImageService) wrapped by k8s.io/cri-client's fake gRPC server, and
// overrides what has to behave like a real runtime: cgroupfs RuntimeConfig,
// pod IPs, container exits, log files, stats, and CDI device injection with
// the real tags.cncf.io/container-device-interface library (as containerd
// does it). Every created container is recorded as a JSON file that tests can
// read. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// stringList is a repeatable string flag.
type stringList struct {
	values []string
	set    bool
}

func (s *stringList) String() string { return strings.Join(s.values, ",") }

func (s *stringList) Set(v string) error {
	if !s.set {
		// The first explicit use replaces the defaults.
		s.values = nil
		s.set = true
	}
	s.values = append(s.values, v)
	return nil
}

// parseFlags parses the command line into a config.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	fs := flag.NewFlagSet("fake-cri", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cdiDirs := &stringList{values: []string{"/etc/cdi", "/var/run/cdi"}}
	var cfg config
	fs.StringVar(&cfg.listen, "listen", "", "path of the unix socket to serve CRI on (required); a stale socket is removed first")
	fs.Var(cdiDirs, "cdi-spec-dir", "CDI spec directory, repeatable (the first use replaces the defaults), later ones have higher priority")
	fs.StringVar(&cfg.recordDir, "record-dir", "", "directory receiving one JSON record per created container (empty: no records)")
	fs.StringVar(&cfg.imageFsPath, "image-fs-path", "/var/lib/migdra-fake-cri", "directory reported as the image and container filesystem mountpoint in ImageFsInfo (created if missing)")
	fs.BoolVar(&cfg.verbose, "v", false, "verbose logging (every CRI call)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: fake-cri --listen /path/to/cri.sock [flags]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if cfg.listen == "" {
		return config{}, errors.New("--listen is required")
	}
	cfg.listen = strings.TrimPrefix(cfg.listen, "unix://")
	cfg.cdiSpecDirs = cdiDirs.values
	return cfg, nil
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("fake-cri: ")
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "fake-cri:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, cfg, nil); err != nil {
		log.Printf("error: %v", err)
		os.Exit(1)
	}
}
