package main

import (
	"math"
	"path"
	"strconv"
	"strings"
	"time"
)

// behaviour is what a fake container "does" once started.
type behaviour struct {
	// exits is false for a container that runs until it is stopped.
	exits bool
	// after is how long the container runs before exiting (when exits).
	after time.Duration
	// exitCode is the exit code of a container that exits by itself.
	exitCode int32
}

// shells whose "-c <script>" form is interpreted.
var shells = map[string]bool{"sh": true, "bash": true, "ash": true, "dash": true}

// modelProcess derives the fake process behaviour from the container's
// command and args (the kubelet passes the pod's command as Command and its
// args as Args; an empty command means the image's default entrypoint).
//
// Understood forms (possibly wrapped in `sh -c "..."`, `bash -c`, ...):
//
//	sleep N            exits 0 after N seconds (N may be fractional or carry
//	                   an s/m/h/d suffix; "infinity" never exits)
//	exit [K]           exits immediately with code K (default 0)
//	true / false       exit immediately with 0 / 1
//	a; b / a && b      sequences of the above: the sleeps add up, the first
//	                   exit ends the sequence, && stops at a failing step
//
// Anything else runs until StopContainer.
func modelProcess(command, args []string) behaviour {
	argv := append(append([]string{}, command...), args...)
	forever := behaviour{}
	if len(argv) == 0 {
		return forever
	}
	if shells[path.Base(argv[0])] && len(argv) >= 3 && argv[1] == "-c" {
		return modelScript(argv[2])
	}
	if path.Base(argv[0]) == "busybox" && len(argv) >= 2 {
		argv = argv[1:]
		if shells[argv[0]] && len(argv) >= 3 && argv[1] == "-c" {
			return modelScript(argv[2])
		}
	}
	b, ok := runStatements([][]string{argv}, []string{""})
	if !ok {
		return forever
	}
	return b
}

// modelScript interprets a tiny subset of shell: statements separated by
// ";", "&&" or newlines.
func modelScript(script string) behaviour {
	var stmts [][]string
	var seps []string // separator before each statement
	sep := ""
	rest := script
	for {
		i := strings.IndexAny(rest, ";&\n")
		var part string
		next := ""
		if i < 0 {
			part = rest
		} else {
			part = rest[:i]
			switch {
			case rest[i] == '&' && strings.HasPrefix(rest[i:], "&&"):
				next = "&&"
				rest = rest[i+2:]
			case rest[i] == '&':
				// A lone "&" (background job) is not modelled.
				return behaviour{}
			default:
				next = ";"
				rest = rest[i+1:]
			}
		}
		if f := strings.Fields(part); len(f) > 0 {
			stmts = append(stmts, f)
			seps = append(seps, sep)
			sep = next
		} else if next == "&&" {
			return behaviour{} // "&&" with an empty left side: not a valid script
		}
		if i < 0 {
			break
		}
	}
	if len(stmts) == 0 {
		// An empty script exits 0 immediately.
		return behaviour{exits: true}
	}
	b, ok := runStatements(stmts, seps)
	if !ok {
		return behaviour{}
	}
	return b
}

// runStatements simulates a statement sequence. ok is false if any
// statement is not understood (then the container runs until stopped).
func runStatements(stmts [][]string, seps []string) (behaviour, bool) {
	var total time.Duration
	status := int32(0)
	// First make sure every statement is understood.
	for _, s := range stmts {
		if _, _, _, ok := statement(s); !ok {
			return behaviour{}, false
		}
	}
	for i, s := range stmts {
		if seps[i] == "&&" && status != 0 {
			break
		}
		d, code, isExit, _ := statement(s)
		if d < 0 {
			return behaviour{}, true // sleep infinity: runs until stopped
		}
		total += d
		status = code
		if isExit {
			break
		}
	}
	return behaviour{exits: true, after: total, exitCode: status}, true
}

// statement models one simple command: its duration (negative: forever),
// exit status, whether it ends the script, and whether it is understood.
func statement(s []string) (time.Duration, int32, bool, bool) {
	name := path.Base(s[0])
	switch name {
	case "sleep":
		if len(s) != 2 {
			return 0, 0, false, false
		}
		d, ok := parseSleep(s[1])
		return d, 0, false, ok
	case "exit":
		if len(s) == 1 {
			return 0, 0, true, true
		}
		if len(s) != 2 {
			return 0, 0, false, false
		}
		k, err := strconv.Atoi(s[1])
		if err != nil {
			return 0, 0, false, false
		}
		return 0, int32(k & 0xff), true, true
	case "true", ":":
		return 0, 0, false, true
	case "false":
		return 0, 1, false, true
	}
	return 0, 0, false, false
}

// parseSleep parses a sleep(1) operand.
func parseSleep(v string) (time.Duration, bool) {
	if v == "infinity" || v == "inf" {
		return -1, true
	}
	mult := time.Second
	switch {
	case strings.HasSuffix(v, "s"):
		v = strings.TrimSuffix(v, "s")
	case strings.HasSuffix(v, "m"):
		v, mult = strings.TrimSuffix(v, "m"), time.Minute
	case strings.HasSuffix(v, "h"):
		v, mult = strings.TrimSuffix(v, "h"), time.Hour
	case strings.HasSuffix(v, "d"):
		v, mult = strings.TrimSuffix(v, "d"), 24*time.Hour
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, false
	}
	d := f * float64(mult)
	if d > float64(math.MaxInt64/2) {
		return -1, true
	}
	return time.Duration(d), true
}
