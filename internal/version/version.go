// Package version holds the build's version, set by the Makefile with
// -ldflags "-X github.com/mgpu-dev/mgpu/internal/version.Version=...".
package version

import (
	"fmt"
	"runtime"
)

// Version is the release version ("dev" in untagged builds).
var Version = "dev"

// Commit is the git commit the build came from.
var Commit = "unknown"

// String returns "VERSION (commit COMMIT, GOVERSION)".
func String() string {
	return fmt.Sprintf("%s (commit %s, %s)", Version, Commit, runtime.Version())
}
