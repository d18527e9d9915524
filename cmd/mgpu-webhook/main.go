// Command mgpu-webhook is mgpu's mutating admission webhook for pods: it
// checks their vke.volcengine.com/mgpu-core and mgpu-memory resources and
// compute-policy annotation, and sends pods that ask for mgpu-core to nodes
// labelled with their policy. `mgpu-webhook cert` makes its certificate.
// See docs/kubernetes.md.
//
//	mgpu-webhook --tls-cert-file FILE --tls-key-file FILE [--listen ADDRESS]
//	mgpu-webhook cert --out DIR [--service NAME] [--namespace NAMESPACE]
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/kube/admission"
)

func main() {
	os.Exit(admission.Command(os.Args[1:], os.Stdout, os.Stderr))
}
