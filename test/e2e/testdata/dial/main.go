// Command dial connects to a Unix socket and copies what the peer sends to
// stdout. The podman test runs it, statically linked, inside a container to
// show that a device's client socket is reachable through the read-only
// bind mount of its directory, also after the socket was recreated.
//
//	dial [-retry DURATION] SOCKET
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"
)

func main() {
	retry := flag.Duration("retry", 0, "keep trying to connect for this long")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: dial [-retry DURATION] SOCKET")
		os.Exit(2)
	}
	deadline := time.Now().Add(*retry)
	for {
		c, err := net.Dial("unix", flag.Arg(0))
		if err == nil {
			_, err = io.Copy(os.Stdout, c)
			_ = c.Close()
			if err != nil {
				fmt.Fprintln(os.Stderr, "dial:", err)
				os.Exit(1)
			}
			return
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "dial:", err)
			os.Exit(1)
		}
		var ne *net.OpError
		if !errors.As(err, &ne) {
			fmt.Fprintln(os.Stderr, "dial:", err)
			os.Exit(1)
		}
		time.Sleep(20 * time.Millisecond) // polling a path that reappears, bounded by -retry
	}
}
