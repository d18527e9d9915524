// Package kubeclient is the clientset of mgpu's Kubernetes components, on
// the API server package kubeconfig finds.
package kubeclient

import (
	"fmt"

	"k8s.io/client-go/kubernetes"

	"github.com/mgpu-dev/mgpu/kube/kubeconfig"
)

// ErrNone is returned (wrapped) when there is no kubeconfig and the process
// does not run in a pod.
var ErrNone = kubeconfig.ErrNone

// Client is a clientset of kubeconfig.Config(path).
func Client(path string) (kubernetes.Interface, error) {
	c, err := kubeconfig.Config(path)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(c)
	if err != nil {
		return nil, fmt.Errorf("the API server: %w", err)
	}
	return cs, nil
}
